"""The aten operations an op count leaves out: views and allocations, which launch no kernel."""

NOT_KERNELS = frozenset({
    "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
    "permute", "t", "alias", "reshape", "detach", "as_strided", "split", "unbind",
    "_reshape_alias", "lift_fresh", "empty", "empty_strided"})
