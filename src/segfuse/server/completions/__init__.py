"""``/v1/completions`` (text completions, echoed prompts) and the tokenizer routes beside it."""
