"""The tiny-llama policy config every RL test builds (one block, 32 wide: seconds per test)."""

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "tokenizer_texts": 300,
}
