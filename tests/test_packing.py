import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mcore.packing import pack, unpack


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 1000, (n,), generator=g) for n in lengths]
    fields = {
        "loss_mask": [torch.rand(n, generator=g) > 0.3 for n in lengths],
        "logprobs": [-torch.rand(n, generator=g) for n in lengths],
        "versions": [torch.randint(-1, 5, (n,), generator=g) for n in lengths],
    }
    return seqs, fields


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), pad=st.integers(1, 8))
def test_unpack_inverts_pack_exactly(lengths, pad):
    seqs, fields = _batch(lengths)
    batch = pack(seqs, fields, pad_to_multiple_of=pad)
    out_seqs, out_fields = unpack(batch)
    assert all(torch.equal(a, b) for a, b in zip(seqs, out_seqs, strict=True))
    for name, values in fields.items():
        assert all(torch.equal(a, b) for a, b in zip(values, out_fields[name], strict=True))
        assert out_fields[name][0].dtype == values[0].dtype


def test_pack_layout_cu_seqlens_positions_and_max_seqlen():
    seqs, fields = _batch([3, 5, 2])
    batch = pack(seqs, fields)
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert torch.equal(batch.cu_seqlens, batch.cu_seqlens_padded)
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert batch.max_seqlen == 5
    assert torch.equal(batch.input_ids, torch.cat(seqs))
    assert batch.seqlens == [3, 5, 2] and batch.num_seqs == 3


def test_padding_aligns_each_sequence_and_is_masked_out_of_the_loss():
    seqs, fields = _batch([3, 5, 8])
    fields["loss_mask"] = [torch.ones(n, dtype=torch.bool) for n in (3, 5, 8)]
    batch = pack(seqs, fields, pad_to_multiple_of=4, pad_token_id=7)
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 16]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 12, 20]
    assert batch.max_seqlen == 8
    pad_positions = [3, 9, 10, 11]
    assert batch.input_ids[pad_positions].tolist() == [7] * 4
    assert not batch.fields["loss_mask"][pad_positions].any()
    assert int(batch.fields["loss_mask"].sum()) == 16
    assert batch.position_ids[8:12].tolist() == [4, 5, 6, 7]


def test_split_maps_a_model_output_back_to_sequences():
    seqs, _ = _batch([2, 4])
    batch = pack(seqs, pad_to_multiple_of=4)
    out = torch.arange(batch.input_ids.numel()).float()
    assert [t.tolist() for t in batch.split(out)] == [[0.0, 1.0], [4.0, 5.0, 6.0, 7.0]]
    with pytest.raises(ValueError, match="tokens"):
        batch.split(out[:-1])


@pytest.mark.parametrize(
    "seqs, fields, match",
    [
        ([], None, "at least one"),
        ([torch.tensor([], dtype=torch.long)], None, "non-empty"),
        ([torch.ones(2, 2, dtype=torch.long)], None, "1-D"),
        ([torch.ones(3, dtype=torch.long)], {"loss_mask": [torch.ones(2)]}, "expected \\(3, \\.\\.\\.\\)"),
        ([torch.ones(3, dtype=torch.long)], {"loss_mask": []}, "0 entries for 1"),
    ],
)
def test_pack_rejects_bad_input_naming_what_is_wrong(seqs, fields, match):
    with pytest.raises(ValueError, match=match):
        pack(seqs, fields)


def test_pack_keeps_a_fields_trailing_dims_and_pads_them_with_zeros():
    """Per-token fields may carry more per token (routed_experts: [n, MoE layers, top_k])."""
    seqs = [torch.arange(3), torch.arange(2)]
    experts = [torch.arange(3 * 6).view(3, 3, 2), -torch.ones(2, 3, 2, dtype=torch.long)]
    b = pack(seqs, {"routed_experts": experts}, pad_to_multiple_of=4)
    assert b.fields["routed_experts"].shape == (8, 3, 2)
    assert not b.fields["routed_experts"][3].any() and not b.fields["routed_experts"][6:].any()
    _, fields = unpack(b)
    assert all(torch.equal(a, e) for a, e in zip(fields["routed_experts"], experts, strict=True))
    assert [t.shape for t in b.select([1]).fields.values()] == [(4, 3, 2)]
