"""Layer ``io``: checkpoints on disk. The format and names (``checkpoint_format``), the atomic
directory protocol (``checkpoint_dir``), save, read and restore, consolidation to one file,
DeepSpeed import, safe unpickling and the key arithmetic of stacked layers (``restack``). It
reaches the engine only through its public state methods (``state_tensors``, ``stacked_layers``,
...) and moves the state's shards through the backend's ``state_shards()`` (``shards``), so that
every backend saves and loads the same format. It may
import ``tpu``, ``observe`` and the layers below them.
"""
