from asyncrl.tasks.base import Prompt, Task, TaskSampler, score

__all__ = ["Prompt", "Task", "TaskSampler", "score"]
