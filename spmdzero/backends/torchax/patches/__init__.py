"""Model families' forwards made traceable: each module is one family's adaptation (transformers'
mixtures of experts, vision-language forwards, DeBERTa's labeled rows, CTC targets, ...). A trace
enters them all through ``patches.entered`` (``patches/registry.py``)."""
