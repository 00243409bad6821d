"""FSDP2 through Lightning's ModelParallelStrategy."""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    """Pure FSDP2: every process holds one data-parallel shard, no tensor parallelism.

    Lightning's ``data_parallel_size="auto"`` means one data-parallel group per *node* (it expects
    tensor parallelism inside a node); sharding across every process needs world-size groups.
    ``AgentRLModule.configure_model`` applies ``fully_shard`` to each decoder layer and the root.
    Works on GPUs (NCCL) and on CPU (gloo).
    """

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
