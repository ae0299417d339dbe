"""Accelerations: backends that build a faster model out of the reference one by substitution.

A backend for a device family places its own modules where the reference's go (a
:class:`~pagedkv.accel.cpu.fused_norms.FusedRMSNorm` *is* an
:class:`~pagedkv.model.layers.RMSNorm`, with the same weight), in a copy of the module tree
that it alone holds: the reference model it was given is never changed, and the reference
classes never learn that an acceleration exists. The golden suites hold every backend
token-exact to the reference.
"""
