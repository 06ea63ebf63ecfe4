"""What the kernel offers, asked safely: files walked by descriptor, processes, users'
access, and the cgroup and PSI files.

- `pathwalk`, `dirfds`: paths opened with O_NOFOLLOW through directory descriptors.
- `processes`: the spawn and wait of child programs.
- `access`: who may do what to a file, computed as the kernel would.
- `probes`: cgroup v2, a slice's directory, the disk behind a path, PSI.
- `pidfds`: a process read by its pidfd, without a pid race.
- `cgroupmove`: a process written into a cgroup in every hierarchy, as systemd does.
"""
