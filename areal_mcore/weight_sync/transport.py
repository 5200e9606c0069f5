"""The trainer's end of one weight-update group, for each kind an engine asks for
(``Engine.trainer_transport``): ``torch`` (SGLang's recipe, ``group.py``; also what the
embedded server and our vLLM ``areal_gloo`` plugin join) or ``vllm_nccl`` (vLLM's own
NCCL weight-transfer engine, joined through vLLM's trainer helper)."""

from __future__ import annotations

from areal_mcore import collectives
from areal_mcore.weight_sync.group import destroy_update_group, init_update_group


class TorchGroup:
    def __init__(self, *, master_address: str, master_port: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float):
        self.pg = init_update_group(master_address=master_address, master_port=master_port,
                                    world_size=world_size, group_name=group_name,
                                    backend=backend, timeout_s=timeout_s)

    def send_bucket(self, tensors) -> None:
        # src 0 is the trainer: the group maps its ranks to themselves (group.py)
        collectives.broadcast_many(tensors, 0, self.pg)

    def close(self) -> None:
        destroy_update_group(self.pg)


class VLLMNcclGroup:
    """vLLM's ``nccl_common.trainer_init``: rank 0 of a ``StatelessProcessGroup`` (it hosts
    the TCPStore) and a ``PyNcclCommunicator`` on the current CUDA device, the exact
    counterpart of the workers' ``worker_init_process_group`` (vllm 0.32
    ``distributed/weight_transfer/nccl_common.py``). Needs ``vllm`` importable here."""

    def __init__(self, *, master_address: str, master_port: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float):
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as e:
            raise RuntimeError("weight_sync.backend=nccl with server.backend=vllm needs vllm "
                               "importable in the trainer (pip install vllm)") from e
        self.comm = trainer_init({"master_address": master_address, "master_port": master_port,
                                  "world_size": world_size})

    def send_bucket(self, tensors) -> None:
        collectives.broadcast_pynccl(tensors, 0, self.comm)

    def close(self) -> None:
        self.comm.destroy()


KINDS = {"torch": TorchGroup, "vllm_nccl": VLLMNcclGroup}


def open_group(kind: str, **kw):
    """Blocks until every server joined (they join concurrently through the engine)."""
    return KINDS[kind](**kw)
