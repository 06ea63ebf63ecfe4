"""What works on this host: `doctor`'s checks of cgroups, the IO scheduler, PSI, the
systemd manager, the socket and each mind's preflight.
"""
