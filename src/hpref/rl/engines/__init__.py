"""Generation: the built-in `transformers_engine`, `vllm_engine`, `EngineHost` (`host`: the Ray actor
around whichever registered engine a recipe names), the request and generation format every engine
shares (`requests`), versioned weight updates (`versioned`) and the sampling knobs (`sampling`). An
engine never imports trainer code: weights arrive through `transport.weight_channel`."""
