"""The hook and its adapter: enable_output_processor at tp=1, tp=2 and pp=2, MTP,
HybridModel, the schedule plan, Megatron's schedules and the RL step through them,
wrappers, the calling layer, the tiny GPT."""
