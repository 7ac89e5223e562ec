"""rollplex: cross-phase scheduling for synchronous GRPO post-training of video vision-language models.

`import rollplex` is cheap: it imports neither torch nor any GPU module.
"""

__version__ = "0.1.0"
