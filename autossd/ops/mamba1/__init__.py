"""Mamba-1's selective scan (`sscan_fwd`, `sscan_bwd`): the float64 reference (`naive`), the
problem type and its validation (`problem`), the ops' knobs, declarations and the drop-in
`selective_scan_fn` (`scan`)."""
