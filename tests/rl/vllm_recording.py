"""A vLLM engine that keeps what its worker was handed to load, for test_vllm_engine.py: the dtypes of
every load (the start weights' and each sync's) as vLLM's worker received them, and the engine's
log-probs of a fixed answer (vLLM's prompt log-probs). Imported by the engine's actor by name (vLLM's
`worker_extension_cls`), so it lives in a module of its own, light to import."""

from __future__ import annotations

from typing import Any

from hpref.rl.engines.vllm_engine import VLLMEngine, WeightLoader


class RecordingLoader(WeightLoader):
    """`WeightLoader` that notes the dtypes of each load before vLLM's reload takes it."""

    def hpref_load_weights(self, state: Any) -> None:
        # each tensor as the worker reads it (by reference, or from the engine's stage file)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
        self.hpref_loads = [*getattr(self, "hpref_loads", []), dtypes]
        super().hpref_load_weights(state)

    def hpref_recorded_loads(self) -> list[list[str]]:
        return getattr(self, "hpref_loads", [])


class RecordingEngine(VLLMEngine):
    worker_extension = RecordingLoader

    def loads(self) -> list[list[str]]:
        """The dtypes of each load the (one) worker received, in order."""
        return self.llm.collective_rpc("hpref_recorded_loads")[0]

    def answer_logprobs(self, prompt_ids: list[int], answer_ids: list[int]) -> list[float]:
        """The log-prob of each token of `answer_ids` after `prompt_ids` (vLLM's prompt log-probs of
        the two together: the full distribution, temperature 1, as the trainer's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        ids = prompt_ids + answer_ids
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return [out.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(answer_ids)]
