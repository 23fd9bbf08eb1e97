"""streamgrpo: asynchronous GRPO for Qwen vision-language models on video and images."""

__version__ = "0.1.0"
