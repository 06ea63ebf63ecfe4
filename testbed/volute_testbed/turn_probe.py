"""The turn probe: the one turn command of the tests, a shell script that logs what each
turn received and how it ended.

The unit tier writes it beside the test's gate (`script(log)`); the system tier installs
it in the container as /usr/local/bin/turn-probe (volute_testbed.gate.install_probe),
logging to /var/tmp/turns.log. A mind's command is then e.g. `turn-probe 0.5`,
`turn-probe 60 take-until-int` or `TURN_EXIT=3 turn-probe 2`.

    turn-probe SECONDS [MODE] [EXIT] [WIND_DOWN]

It holds the turn open for at most SECONDS. MODE:
- take (the default): take the inbox while holding, and once more at the end; a SIGINT
  is logged and changes nothing;
- leave: never take the inbox;
- take-until-int: as take, but end once it has taken what was in its inbox when a SIGINT
  came (the gate offers an interrupt's delivery before its SIGINT);
- exit-on-int: as take, but after a SIGINT it takes the inbox, winds down for WIND_DOWN
  seconds (0) and ends the turn with status 130.

EXIT is the status it ends with ($TURN_EXIT, else 0), or 1/N: 1 once in N turns at
random, else 0 (the kill storms' retried failures).

Its log, one line per event, words split by spaces (volute_testbed.gate.turn_log):

    start MIND SESSION TURN_ID USER ID...   the delivery ids on its stdin
    took MIND SESSION TURN_ID ID            a delivery folded in, taken from the inbox
    sigint MIND SESSION TURN_ID
    end MIND SESSION TURN_ID STATUS
"""

from __future__ import annotations

TURNS_LOG = "/var/tmp/turns.log"  # in the container

_SCRIPT = r"""#!/bin/sh
# turn-probe SECONDS [take|leave|take-until-int|exit-on-int] [EXIT|1/N] [WIND_DOWN]:
# see volute_testbed/turn_probe.py.
log=@LOG@
hold=${1:-0.1}
mode=${2:-take}
status=${3:-${TURN_EXIT:-0}}
wind_down=${4:-0}
turn="$VOLUTE_MIND $VOLUTE_SESSION $VOLUTE_TURN_ID"
# Only ever inside a turn: it deletes files from its inbox, so without one it stops.
if [ -z "$VOLUTE_INBOX" ] || [ ! -d "$VOLUTE_INBOX" ]; then
  echo "turn-probe: no VOLUTE_INBOX: not in a turn" >&2
  exit 64
fi
case $status in
  1/*)
    one_in=${status#1/}
    status=0
    if [ "$one_in" -gt 0 ] && [ $(( $(od -An -N2 -tu2 /dev/urandom) % one_in )) -eq 0 ]; then
      status=1
    fi
    ;;
esac
# The trap is set before the start line is logged: a test that waits for that line and
# then asks for an interrupt must find it set. It only notes the SIGINT: the shell runs
# it between two commands, and one that ended the turn itself could fall between take's
# rm and its log line, so that a delivery taken went unlogged. The loop acts on it.
interrupted=
trap 'interrupted=1; echo "sigint $turn" >> $log' INT
# Milliseconds: mawk's printf %d stops at 2^31, so nanoseconds would cap holds at 2.1 s.
# A SIGINT that kills awk or date leaves an empty reading: read again (an empty operand
# would end the shell with an arithmetic error, a turn that took nothing).
hold_ms=
while [ -z "$hold_ms" ]; do hold_ms=$(echo "$hold" | awk '{printf "%d", $1 * 1000}'); done
ids=$(sed -n 's/.*"id": *\([0-9][0-9]*\).*/\1/p' | tr '\n' ' ')
began=
while [ -z "$began" ]; do began=$(date +%s%3N); done
end=$(( began + hold_ms ))
user=
while [ -z "$user" ]; do user=$(id -un); done
echo "start $turn $user $ids" >> $log
# A SIGINT goes to the whole scope and kills whichever child runs then (date, rm): an
# empty clock reading goes round again, a file's id comes from builtins, and a file is
# taken once it is gone, whatever rm's status.
take() {
  [ "$mode" = leave ] && return
  for f in "$VOLUTE_INBOX"/*.json; do
    [ -e "$f" ] || continue
    id=${f##*/}
    id=${id%.json}
    rm -f "$f"
    [ -e "$f" ] || echo "took $turn $id" >> $log
  done
}
while now=$(date +%s%3N); [ -z "$now" ] || [ "$now" -lt "$end" ]; do
  before=$interrupted
  take
  [ "$mode" = take-until-int ] && [ -n "$before" ] && break
  if [ "$mode" = exit-on-int ] && [ -n "$interrupted" ]; then
    take
    sleep "$wind_down"
    echo "end $turn 130" >> $log
    exit 130
  fi
  sleep 0.02
done
[ "$mode" = take-until-int ] || take
echo "end $turn $status" >> $log
exit $status
"""


def script(log: str = TURNS_LOG) -> str:
    """The probe's text, logging to `log`."""
    return _SCRIPT.replace("@LOG@", log)
