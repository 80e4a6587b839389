package embedded

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestStartRefusesTooFewServersOrNoStore(t *testing.T) {
	_, err := Start(Options{Servers: 1, Dir: t.TempDir()})
	require.ErrorContains(t, err, "need 2 or more")
	_, err = Start(Options{Servers: 3})
	require.ErrorContains(t, err, "no store directory")
}

// The cluster forms, forms again after a server's restart, and Stop and
// Restart refuse the wrong state.
func TestFormsStopsAndRestarts(t *testing.T) {
	c, err := Start(Options{Servers: 3, Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(c.Close) // registered after TempDir: runs first
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, c.WaitFormed(ctx))
	require.Equal(t, 3, c.Size())
	require.Contains(t, c.URLs(1), c.URL(1)+",")

	require.NoError(t, c.Stop(1))
	require.Error(t, c.Stop(1), "already stopped")
	// What a wait that times out reports: each running server's view of
	// the meta group, and no stopped server's.
	meta := c.metaGroups()
	view := `(LEADER|FOLLOWER|CANDIDATE) term \d+ vote \w+ leader \w+ commit \d+ applied \d+ pterm \d+ pindex \d+(, peer s\d (never seen|seen \S+ ago))*`
	require.Regexp(t, `^s0 `+view+`; s2 `+view+`$`, meta)
	require.NotContains(t, meta, "; s1 ")
	require.Nil(t, c.Server(1))
	require.NoError(t, c.Restart(1))
	require.Error(t, c.Restart(1), "already running")
	require.NoError(t, c.WaitFormed(ctx))

}

// A wait that times out says what is missing and each running server's
// view of the meta group: here s2's routes all lead to a listener that
// hangs up at once, so s0 and s1 form a quorum without it and the cluster
// never forms.
func TestAWaitThatTimesOutReportsTheMetaGroup(t *testing.T) {
	hangUp, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = hangUp.Close() })
	go func() {
		for {
			c, err := hangUp.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	c, err := Start(Options{Servers: 3, Dir: t.TempDir(), RouteVia: func(from, to int, addr string) string {
		if from == 2 || to == 2 {
			return hangUp.Addr().String()
		}
		return addr
	}})
	require.NoError(t, err)
	t.Cleanup(c.Close)

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err = c.WaitFormed(ctx)
	require.ErrorIs(t, err, ErrNotFormed)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Regexp(t, `is routed to fewer than 2 others \(context deadline exceeded\); meta group: s0 \w+ term \d+ .*; s1 \w+ term \d+ .*; s2 \w+ term \d+ `, err.Error())
}

// Under RouteVia every server advertises one route address, which refuses
// connections and which no other socket can take while the cluster runs:
// a server told of another by gossip dials it, fails and gives up, so every
// route stays one a test's RouteVia chose. (Freed again, as it once was,
// the port could become one of the test's own route proxies, to another
// server: a cut of one server then missed a route of it, seen as a
// keep-alive through a cut-off server that succeeded.)
func TestRouteViaAdvertisesAnAddressThatRefusesForTheClustersLife(t *testing.T) {
	via := 0
	c, err := Start(Options{Servers: 3, Dir: t.TempDir(), RouteVia: func(_, _ int, addr string) string {
		via++
		return addr
	}})
	require.NoError(t, err)
	t.Cleanup(c.Close) // a second Close does nothing
	require.Equal(t, 6, via, "one route per server and peer")
	nowhere := c.opts[0].Cluster.Advertise
	require.NotEmpty(t, nowhere)
	for _, o := range c.opts {
		require.Equal(t, nowhere, o.Cluster.Advertise, "one address for every server")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, c.WaitFormed(ctx))

	_, err = net.DialTimeout("tcp", nowhere, time.Second)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "a dial of the advertised address")
	_, err = net.Listen("tcp", nowhere)
	require.ErrorIs(t, err, syscall.EADDRINUSE, "no listener takes the advertised port while the cluster runs")
	for i := range 3 {
		rz, err := c.Server(i).Routez(nil)
		require.NoError(t, err)
		require.NotEmpty(t, rz.Routes)
		for _, r := range rz.Routes {
			require.False(t, r.DidSolicit && !r.IsConfigured, "s%d dialed an implicit route to %s:%d", i, r.IP, r.Port)
		}
	}

	c.Close()
	l, err := net.Listen("tcp", nowhere)
	require.NoError(t, err, "the port is released by Close")
	require.NoError(t, l.Close())
}
