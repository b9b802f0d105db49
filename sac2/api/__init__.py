"""The public entry points, with torch's signatures: ``checkpoint``, ``create_selective_checkpoint_contexts``, the
module wrappers (``checkpoint_wrapper``, ``apply_activation_checkpointing``, ...) and ``apply_ac``; and where 0.4's
module paths went, so that its pickles load (``moved``)."""

__all__: list[str] = []
