"""Process groups (``env``) and the strategies that wrap a model for DDP, FSDP2 or DeepSpeed ZeRO."""
