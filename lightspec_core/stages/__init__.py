"""Stages: the tensor contract between engine and stages (``contract``), the stage runners
(``target``, ``mtp``) and the executors that reach them (``executor``)."""
