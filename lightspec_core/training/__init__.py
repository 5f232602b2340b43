"""Training MTP heads for a target checkpoint, the target frozen (``lightspec train-heads``).

- :mod:`.data`: the user's text files, split into training and held-out documents, tokenized;
- :mod:`.distill`: the heads' teacher-forced chain, the self-distillation loss, and the target's own
  greedy continuations to train on;
- :mod:`.evaluate`: how often the heads' drafts equal the target's greedy tokens;
- :mod:`.loop`: the budgeted, resumable training loop;
- :mod:`.train_heads`: the command.

Importing this package imports nothing heavy; its modules import torch.
"""
