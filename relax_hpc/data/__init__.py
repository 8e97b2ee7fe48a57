"""Prompts: built-in synthetic tasks or JSONL/Parquet files, tokenized once, streamed in resumable epochs."""

from relax_hpc.data.dataset import Prompt, PromptDataset
from relax_hpc.data.stream import PromptStream, make_stream
from relax_hpc.data.tasks import generate_task, task_answer

__all__ = ["Prompt", "PromptDataset", "PromptStream", "generate_task", "make_stream", "task_answer"]
