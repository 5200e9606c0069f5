"""Math datasets: boba-format JSONL loading, a seeded resumable sampler, a synthetic task."""
