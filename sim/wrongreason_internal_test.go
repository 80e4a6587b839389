package sim

import (
	"testing"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// A request owes one "finished" release and the node sends it as
// "preempted" (or "aborted"): the check fails. It passed, since onReleased
// re-filed any reason not owed under the oldest owed one, as it does the
// reasons that answer whatever was owed (node_lost, engine_reset,
// engine_gone).
func TestAReleaseOfTheWrongReasonFailsTheCheck(t *testing.T) {
	for _, wrong := range []string{messages.ReasonPreempted, messages.ReasonAborted} {
		cfg := DefaultConfig()
		e := &engine{cfg: cfg, al: newAllocator(&cfg), byID: map[string]*request{}, rep: Report{Releases: map[string]int{}}}
		r := &request{id: "r1", expected: map[string]int{}, received: map[string]int{}, held: map[string][][][]uint32{},
			blocks: make([][]uint32, len(cfg.Groups)), written: make([]int, len(cfg.Groups))}
		e.reqs, e.byID["r1"] = []*request{r}, r
		r.hold(messages.ReasonFinished) // the finished event owes "finished"
		e.owed = 1
		e.onReleased(client.Release{Request: "r1", Reason: wrong})
		e.settleReleases()
		t.Logf("released as %q: Err=%v releases=%v", wrong, e.rep.Err(), e.rep.Releases)
		if e.rep.Err() == nil {
			t.Errorf("a finished request released as %q passed the check", wrong)
		}
	}
}
