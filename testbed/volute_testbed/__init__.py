"""volutectl's test bed: what tests/, bench/ and demo/ share.

Installed editable into the development venv by packaging/dev-setup, from this
checkout; it never ships in the volutectl wheel or the Debian package.

- `paths`: the checkout under test, and the interpreter the tests run with.
- `machine`: a throwaway systemd booted with systemd-nspawn over an overlay of a root
  (`boot`), and `dev_machine`, the one the system tests, benchmarks and demo use.
- `gate`: the real gate service in such a machine (units, config, probes, queries).
- `faults`, `chaos`: the fault tests' probe and checks, and the kill storm.
- `scope_sampler`: runs inside a machine, samples live scopes from systemd.
- `slowdisk`: a throttled loop-device disk for IO-pressure runs; `diskprobe`, the
  synced-write latency probe on it; `fanout`, a fan-out's turns timed by their own log.
- `rootfs`, `binfmt`, `install_tier`: a debootstrapped Debian root, qemu-user for arm64,
  and the package installed in a booted root.
- `junit`: the test tiers in the junit report, and the run's verdict over it.
"""
