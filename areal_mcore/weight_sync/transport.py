"""The trainer's end of one weight-update group, for each kind an engine asks for
(``Engine.trainer_transport``): ``torch`` (SGLang's recipe, ``group.py``; also what the
embedded server and our vLLM ``areal_gloo`` plugin join) or ``vllm_nccl`` (vLLM's own
NCCL weight-transfer engine, joined through vLLM's trainer helper)."""

from __future__ import annotations

from torch.distributed import distributed_c10d as c10d

from areal_mcore import collectives
from areal_mcore.weight_sync.group import destroy_update_group, init_update_group


class TorchGroup:
    def __init__(self, *, master_address: str, master_port: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float):
        self.pg = init_update_group(master_address=master_address, master_port=master_port,
                                    world_size=world_size, group_name=group_name,
                                    backend=backend, timeout_s=timeout_s)
        self.backend = backend

    def send_bucket(self, tensors, timeout_s: float) -> None:
        # src 0 is the trainer: the group maps its ranks to themselves (group.py)
        collectives.broadcast_many(tensors, 0, self.pg, timeout_s=timeout_s)

    def close(self) -> None:
        if self.pg is not None:
            destroy_update_group(self.pg)
            self.pg = None

    def abort(self) -> None:
        """Ends the group with a broadcast that cannot complete. NCCL: the communicator is
        aborted, which ends the pending broadcast at once (``_abort_process_group``; NCCL's
        destroy would wait for it). Gloo: neither abort nor destroy ends a pending send
        (measured: it runs to its ``timeout_s``), so the group is only destroyed."""
        if self.pg is not None and self.backend == "nccl":
            c10d._abort_process_group(self.pg)
            self.pg = None
        self.close()


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

    def send_bucket(self, tensors, timeout_s: float) -> None:
        collectives.broadcast_pynccl(tensors, 0, self.comm, timeout_s=timeout_s)

    def close(self) -> None:
        # vLLM 0.32's destroy is ncclCommAbort (on a thread it joins for 5 s at most):
        # it also ends a pending broadcast.
        self.comm.destroy()

    abort = close


KINDS = {"torch": TorchGroup, "vllm_nccl": VLLMNcclGroup}


def open_group(kind: str, **kw):
    """Blocks until every server joined (they join concurrently through the engine)."""
    return KINDS[kind](**kw)
