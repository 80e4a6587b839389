package client_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// TestARequestIDTheProtocolForbidsIsRefusedAtAdded: an id that is not
// UTF-8 (the wire would carry U+FFFD in its place, so the node's release
// would name another request) or over 256 bytes (the node rejects it) is
// refused by Added with ErrBadRequestID, and no event naming it is sent:
// the engine is told at the call instead of waiting for a release that
// never names it.
func TestARequestIDTheProtocolForbidsIsRefusedAtAdded(t *testing.T) {
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	bad := []string{"r\xff", strings.Repeat("x", 257), ""}
	for _, id := range bad {
		require.ErrorIs(t, c.Added(id, 8), client.ErrBadRequestID, "id %q", id)
		require.ErrorIs(t, c.AddedMax(id, 8, 4), client.ErrBadRequestID, "id %q", id)
		c.Hashes(id, 0, []byte{1})
		c.Blocks(id, 0, 0, []uint32{1, 2})
		c.Tokens(id, 8, 8)
		c.Preempted(id)
		c.Resumed(id)
		c.Finished(id, false, 8, 8)
	}
	longest := strings.Repeat("é", 128) // 256 bytes
	require.NoError(t, c.Added(longest, 8))
	c.Finished(longest, false, 8, 8)
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		evs := f.events(epoch)
		if len(evs) < 2 {
			return fmt.Errorf("the node applied %d events", len(evs))
		}
		for _, ev := range evs {
			if ev.Request != longest {
				return fmt.Errorf("an event naming %q was sent", ev.Request)
			}
		}
		return nil
	})
	st := c.Stats()
	require.Equal(t, len(bad)*8, st.BadRequestIDs)
	require.Zero(t, st.Awaiting)
}
