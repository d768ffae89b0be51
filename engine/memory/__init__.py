"""KV memory below the models: the slot pools, the slot table shared by target and draft, and DeepSeek-V4's compressed pools."""
