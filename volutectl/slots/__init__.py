"""Test slots: capping concurrent test runs across a repository's worktrees.

- `slotfiles`: take one of N flock slot files, waiting on inotify.
- `testrun`: run a command under the cap, in a scope in the tests slice (`volutectl
  test`'s work); `scopes`: the tests slice's scopes; `gitdirs`: a repository's common
  dir; `proclocks`: who holds a slot.
- `watch`, `registry`: the gate's view of registered repositories' slots.
"""
