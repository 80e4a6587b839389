package client_test

import (
	"testing"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A heartbeat of an older boot the engine never registered with (boot0,
// which died before boot1 started), delivered after the engine registered
// with boot1, is no restart: boot1 still answers, so nothing it holds may
// be freed and no load sent to it settled. (The reviewer's reproduction.)
func TestAnOlderBootNeverRegisteredWithIsNoRestart(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease, func(f *fakeNode) {
		f.holdRelease = func(uint64) bool { return true } // boot1 still stores r1
		f.dropLoads = true                                // boot1 still runs the load
	})
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	oneRequest(t, c, "r1")
	d := loadInDoubt(t, c)
	f.publish(messages.NodeSubject("kvactors", "n1", messages.NodeVerbHeartbeat),
		messages.NodeHeartbeat{Node: "n1", Boot: "boot0"})
	testkit.NoRecv(t, rels.ch, 3*testLease, "a release of r1 while boot1 is alive and never released it")
	select {
	case <-d.Settled():
		t.Errorf("the load to boot1 was settled while boot1 is alive and may still write its blocks")
	default:
	}
	if st := c.Stats(); st.NodeLosses != 0 || !c.Live() {
		t.Errorf("boot0's late heartbeat cost a node loss: %d losses, live %v", st.NodeLosses, c.Live())
	}
}
