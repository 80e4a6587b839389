package client

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The order rules of boots.go: only a probe sent after a suspicion settles
// it, and only a reply to a request sent after the registration proves a
// restart.
func TestOnlyALaterProbeSettlesASuspicion(t *testing.T) {
	t.Parallel()
	c := &Client{node: "n1", boot: "b1", lease: time.Second, loads: map[*loadWait]struct{}{},
		cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	c.regAt = c.probes // registered with b1
	early := c.probeLocked()
	c.seenLocked("n1", "b0") // a late heartbeat of an older process
	require.False(t, c.lost, "a message that proves nothing is no restart")
	require.Contains(t, c.suspects, "b0")

	c.repliedLocked("n1", "b1", early)
	require.Contains(t, c.suspects, "b0", "b1's answer to a probe sent before b0 was seen says nothing of b0")
	c.repliedLocked("n1", "b1", c.probeLocked())
	require.NotContains(t, c.suspects, "b0")
	require.True(t, c.isPastBoot("b0"), "b1 answered after b0 was seen: b0 is older")
	c.seenLocked("n1", "b0")
	require.Empty(t, c.suspects, "a past boot is no news")

	// A register taking effect after a request was sent: another boot's
	// answer to it may be older than the new registration.
	before := c.probeLocked()
	c.regAt = c.probes
	c.repliedLocked("n1", "b2", before)
	require.False(t, c.lost)
	require.Contains(t, c.suspects, "b2")
	c.repliedLocked("n1", "b2", c.probeLocked())
	require.True(t, c.lost, "b2 answered a probe sent after the registration: the node restarted")
	require.True(t, c.otherBoot)
	require.NotContains(t, c.suspects, "b2")
	require.Equal(t, 2, c.st.BootsSuspected)
	require.Equal(t, 1, c.st.BootsStale)
}
