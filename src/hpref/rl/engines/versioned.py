"""The weight-update steps every engine shares: staged, checked whole, then swapped in.

`VersionedWeights` is the second half of the `Engine` protocol (`hpref.rl.protocols`) as a base
class: the built-in transformers engine (`hpref.rl.engines.transformers_engine`) and the vLLM engine
(`hpref.rl.engines.vllm_engine`) inherit it, and an engine plugin may too.
"""

from __future__ import annotations

from typing import Any

from hpref.rl.engines.staging import StagedUpdate


class VersionedWeights:
    """The weight-update steps every engine shares (the `Engine` protocol's second half).

    Three steps so a failed transfer never leaves half-loaded weights serving: `begin_update(version)`
    opens a stage (`hpref.rl.engines.staging.StagedUpdate`: a temporary file, so the parts waiting
    for the commit are not a second copy of the model in the engine's memory), `load_weights(state)`
    writes to it (in parts, if the sender splits it), `commit_update()` checks it is whole
    (`check_state`) and hands them to the engine's `_swap_in` (or `abort_update()` drops it): a
    mapping that reads each tensor from the stage when asked, so `_swap_in` should copy tensor by
    tensor (as both built-in engines do) rather than gather them all first. An engine sets
    `policy`, `shapes` (every weight name of its model with its shape) and `version = 0`, and
    implements `_swap_in(state)`, which must leave the old weights serving when it raises.

    A shared-base engine (`rl.share_base`) serves one LoRA adapter per policy: every step then names
    the `adapter`, which has a version of its own; the engine sets `adapter_shapes` (each adapter's
    tensor names, PEFT's saved ones, with their shapes; its version starts at 0) and implements
    `_swap_in_adapter(adapter, state)`.
    """

    policy: str
    version: int
    shapes: dict[str, tuple[int, ...]]
    #: a shared-base engine's adapters: {adapter: {tensor name: shape}} (empty: no adapters)
    adapter_shapes: dict[str, dict[str, tuple[int, ...]]]
    #: the torch dtype name of the engine's weights: a sync sends them in it (half the bytes of fp32
    #: for a bf16 engine, and nothing for the engine to cast)
    dtype: str = "float32"

    #: refuse a floating-point tensor in another dtype than `dtype` (an engine whose load takes
    #: tensors as given: vLLM's); off, the engine's own load casts (torch's `load_state_dict`)
    exact_dtype: bool = False

    def weight_dtype(self) -> str:
        return self.dtype

    #: where the engine takes a sync's bytes: "cuda" for an engine on a GPU (NCCL from a GPU
    #: trainer), else "cpu" (gloo)
    channel_device: str = "cpu"
    _channel: Any = None

    def weight_channel_device(self) -> str:
        return self.channel_device

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        """Join the trainer's weight channel as its rank 1 (`hpref.rl.transport.weight_channel`)."""
        import torch

        from hpref.rl.transport.weight_channel import connect

        where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self._channel = connect(None, host, port, 1, where)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...]]], adapter: str | None = None) -> None:
        """One bucket of a sync from the channel, staged like `load_weights`'s part."""
        import torch

        if self._channel is None:
            raise RuntimeError(f"engine '{self.policy}': receive_weights before connect_weight_channel")
        self.load_weights(self._channel.receive(layout, getattr(torch, self.dtype)), adapter)

    def sleep(self) -> None:
        """Free what the engine holds on its device while its colocated trainer steps (`rl.colocate`);
        an engine with nothing to free (on the CPU) keeps it. `wake` brings it back."""
        return None

    def wake(self) -> None:
        return None

    @property
    def _stagings(self) -> dict[str | None, StagedUpdate]:
        """Open updates by adapter (None: the whole model)."""
        return self.__dict__.setdefault("_open_updates", {})

    @property
    def _staging(self) -> StagedUpdate | None:
        """The whole model's open update, if any."""
        return self._stagings.get(None)

    def _who(self, adapter: str | None) -> str:
        return f"engine '{self.policy}'" + (f" adapter '{adapter}'" if adapter is not None else "")

    def _adapter_shapes(self, adapter: str) -> dict[str, tuple[int, ...]]:
        shapes = getattr(self, "adapter_shapes", {})
        if adapter not in shapes:
            raise KeyError(f"engine '{self.policy}': no adapter '{adapter}' (it serves {', '.join(shapes)})")
        return shapes[adapter]

    def begin_update(self, version: int, adapter: str | None = None) -> None:
        live = self.get_version(adapter)
        if version < live:
            raise ValueError(f"{self._who(adapter)}: version {version} is older than the live {live}")
        self.abort_update(adapter)  # an update left open by a sync that died before its abort
        self._stagings[adapter] = StagedUpdate(version)

    def load_weights(self, state: dict[str, Any], adapter: str | None = None) -> None:
        if adapter not in self._stagings:
            raise RuntimeError(f"{self._who(adapter)}: load_weights without begin_update")
        self._stagings[adapter].add(state)

    def commit_update(self, adapter: str | None = None) -> int:
        if adapter not in self._stagings:
            raise RuntimeError(f"{self._who(adapter)}: commit_update without begin_update")
        stage = self._stagings.pop(adapter)
        try:
            # before the first copy: torch's strict load_state_dict copies every matching tensor and
            # only then raises for a missing or misshapen one, which left a part of the new weights
            # serving under the old version
            self.check_state(stage.meta(), adapter)
            if adapter is None:
                self._swap_in(stage.state())
                self.version = stage.version
            else:
                self._swap_in_adapter(adapter, dict(stage.state()))
                self.__dict__.setdefault("adapter_versions", {})[adapter] = stage.version
        finally:
            stage.close()
        return stage.version

    def check_state(self, state: dict[str, Any], adapter: str | None = None) -> None:
        """Every weight name of the model (or of the adapter), each with its shape (and, for an
        `exact_dtype` engine, in its dtype), and nothing else; else a refusal that names what
        differs and the version that keeps serving."""
        shapes = self.shapes if adapter is None else self._adapter_shapes(adapter)
        missing = sorted(set(shapes) - set(state))
        unknown = sorted(set(state) - set(shapes))
        wrong = sorted(n for n in set(state) & set(shapes) if tuple(state[n].shape) != shapes[n])
        cast = sorted(
            n
            for n, t in state.items()
            if self.exact_dtype and t.is_floating_point() and str(t.dtype) != f"torch.{self.dtype}"
        )
        if missing or unknown or wrong or cast:
            kinds = (
                ("missing", missing),
                ("unknown", unknown),
                ("wrong shape", wrong),
                (f"not in the engine's {self.dtype}", cast),
            )
            parts = [
                f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in kinds if names
            ]
            raise ValueError(
                f"{self._who(adapter)}: weight update refused ({'; '.join(parts)}); "
                f"version {self.get_version(adapter)} keeps serving"
            )

    def abort_update(self, adapter: str | None = None) -> None:
        stage = self._stagings.pop(adapter, None)
        if stage is not None:
            stage.close()

    def get_version(self, adapter: str | None = None) -> int:
        if adapter is None:
            return self.version
        self._adapter_shapes(adapter)  # an unknown adapter is an error, not version 0
        return self.__dict__.get("adapter_versions", {}).get(adapter, 0)

    def _swap_in(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _swap_in_adapter(self, adapter: str, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"engine '{self.policy}' serves no adapters")
