"""Where the time goes: FLOPs and MFU, stragglers, profiler traces, metric loggers, run reports.

Each module is one concern and imports its optional libraries (tensorboard, mlflow, wandb,
matplotlib) only when used, so ``import hpctrain.telemetry`` stays cheap.
"""
