"""The public entry points, with torch's signatures: ``checkpoint``, ``create_selective_checkpoint_contexts``, the
module wrappers (``checkpoint_wrapper``, ``apply_activation_checkpointing``, ...) and ``apply_ac``."""

__all__: list[str] = []
