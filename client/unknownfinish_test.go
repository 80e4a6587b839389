package client_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The node answers a finished for a request it does not hold with a
// release at once (PROTOCOL.md): for one never added, or one finished a
// second time after its release. Those releases answer the engine's own
// Finished calls and are not counted as unexpected; a release for a
// request that neither holds nor was finished still is.
func TestTheReleaseAnsweringAFinishedOfAnUnheldRequestIsExpected(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})

	require.NoError(t, c.Finished("ghost", false, 0, 0)) // never added
	require.NoError(t, c.Flush())
	oneRequest(t, c, "r1")
	require.Equal(t, "r1", testkit.Recv(t, rels.ch, 5*time.Second, "r1's release").Request)
	require.NoError(t, c.Finished("r1", false, 8, 8)) // again, after its release
	require.NoError(t, c.Flush())
	// Releases reach the engine in rseq order: r2's comes after the
	// answers to both Finished calls above.
	oneRequest(t, c, "r2")
	require.Equal(t, "r2", testkit.Recv(t, rels.ch, 5*time.Second, "r2's release").Request)
	st := c.Stats()
	require.Zero(t, st.UnexpectedRel, "the answers to the engine's own Finished calls")
	require.Zero(t, st.StaleReleases)
	testkit.NoRecv(t, rels.ch, 50*time.Millisecond, "a release handed to the engine for ghost or r1's repeat")

	// A finished release nobody asked for is still unexpected, as is a
	// second answer to ghost's one Finished.
	for _, req := range []string{"nobody", "ghost"} {
		f.mu.Lock()
		f.released++
		rel := messages.Released{Request: req, Epoch: c.Epoch(), RSeq: f.released, Reason: messages.ReasonFinished}
		f.mu.Unlock()
		body, err := json.Marshal(rel)
		require.NoError(t, err)
		require.NoError(t, nc.Publish(messages.EngineSubject("kvactors", "e1", messages.VerbReleased), body))
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := c.Stats().UnexpectedRel; n != 2 {
			return fmt.Errorf("UnexpectedRel %d, want 2", n)
		}
		return nil
	})
}

// A second Finished of a request whose release has not come yet is the
// engine's mistake, answered by no OnReleased call (Finished's doc): it
// sends nothing. Sent, the node would answer it with a second release
// once it had released the first (the fake node does at once), which the
// engine never waits for: counted as unexpected.
func TestASecondFinishedBeforeItsReleaseSendsNothing(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})

	require.NoError(t, c.Added("r1", 8))
	require.NoError(t, c.Finished("r1", false, 8, 8))
	require.NoError(t, c.Finished("r1", true, 4, 8)) // again, with other values
	require.NoError(t, c.Flush())
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "r1's release")
	require.Equal(t, messages.ReasonFinished, rel.Reason, "the second Finished changed the first")
	oneRequest(t, c, "r2") // its release comes after any answer to the second Finished
	require.Equal(t, "r2", testkit.Recv(t, rels.ch, 5*time.Second, "r2's release").Request)
	finished := 0
	for _, ev := range f.events(c.Epoch()) {
		if ev.Request == "r1" && ev.Type == messages.EvFinished {
			finished++
		}
	}
	require.Equal(t, 1, finished, "finished events of r1 sent")
	require.Zero(t, c.Stats().UnexpectedRel)
}
