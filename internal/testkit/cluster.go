package testkit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/embedded"
)

// clusterFormTimeout bounds the wait for routes and a JetStream meta leader:
// a fresh 3-server cluster elects one in about a second on loopback.
const clusterFormTimeout = 20 * time.Second

// Cluster is a NATS cluster of embedded servers on 127.0.0.1 (package
// cluster/embedded) bound to a test: each server has JetStream and its own
// store under t.TempDir(), and failures fail the test. Servers are
// numbered from 0. Its methods may be called from the test goroutine only.
type Cluster struct {
	*embedded.Cluster
	t testing.TB
}

// NATSCluster starts an n-server NATS cluster (n ≥ 2; 3 is the usual) and
// waits until every server is routed to the others and JetStream has a meta
// leader that counts all n peers. NATS_LOGGING=debug|trace turns on the
// servers' logs. Every server is shut down when the test ends, before its
// store is removed.
func NATSCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	return natsCluster(t, n, nil)
}

func natsCluster(t testing.TB, n int, via func(from, to int, addr string) string) *Cluster {
	t.Helper()
	dir := t.TempDir() // before the shutdown's clean-up, so removed after it
	// A name of its own: a route port one test's cluster freed and
	// another's reused could otherwise join the two (tests run in parallel),
	// while NATS refuses a route between clusters of different names.
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	c, err := embedded.Start(embedded.Options{
		Servers: n, Dir: dir, Name: "kvactors-test-" + hex.EncodeToString(suffix[:]),
		Debug: os.Getenv("NATS_LOGGING") == "debug", Trace: os.Getenv("NATS_LOGGING") == "trace",
		RouteVia: via,
	})
	require.NoError(t, err, "start a %d-server NATS cluster", n)
	t.Cleanup(c.Close)
	tc := &Cluster{Cluster: c, t: t}
	tc.WaitFormed()
	return tc
}

// WaitFormed waits (bounded) until the cluster is formed again.
func (c *Cluster) WaitFormed() {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterFormTimeout)
	defer cancel()
	require.NoError(c.t, c.Cluster.WaitFormed(ctx), "wait for the NATS cluster to form")
}

// Server returns server i, or nil while it is stopped.
func (c *Cluster) Server(i int) *server.Server { return c.Cluster.Server(i) }

// Connect connects a client to server i (and knows the others, to fail
// over to), closed when the test ends. Reconnects never give up while the
// test runs, and server order is kept so the client starts on server i.
func (c *Cluster) Connect(i int, opts ...nats.Option) *nats.Conn {
	t := c.t
	t.Helper()
	all := append([]nats.Option{
		nats.Name(fmt.Sprintf("%s@s%d", t.Name(), i)),
		nats.DontRandomize(),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(20 * time.Millisecond),
	}, opts...)
	nc, err := nats.Connect(c.URLs(i), all...)
	require.NoError(t, err, "connect to NATS server %d at %s", i, c.URL(i))
	t.Cleanup(nc.Close)
	return nc
}

// routeWaitTimeout bounds WaitRoutedTo: on loopback interest crosses a
// route in milliseconds, seconds on a loaded 2-core machine.
const routeWaitTimeout = 10 * time.Second

// WaitRoutedTo waits (bounded) until every other running server forwards
// a message on subject to the server of id: its route from that server
// carries a subscription that matches subject. A client's subscription
// reaches the other servers asynchronously, after its Flush: a message
// published on one of them just after may reach nobody on the server it is
// connected to (a register sent to a node that has just started, for one).
func (c *Cluster) WaitRoutedTo(id, subject string) {
	c.t.Helper()
	c.waitRoutedTo(id, subject, routeWaitTimeout)
}

func (c *Cluster) waitRoutedTo(id, subject string, timeout time.Duration) {
	c.t.Helper()
	if id == "" { // nats.Conn.ConnectedServerId of a client not connected
		c.t.Fatalf("wait for interest in %s routed to no server: the subscriber's client is not connected", subject)
	}
	Eventually(c.t, timeout, 5*time.Millisecond, func() error {
		for i := range c.Size() {
			if from := c.Server(i); from != nil && from.ID() != id {
				if err := routes(from, id, subject); err != nil {
					return fmt.Errorf("server %d: %w", i, err)
				}
			}
		}
		return nil
	})
}

// routes is nil when from has a route from the server of id that carries
// a subscription matching subject (a route's subscription is its subject,
// then its queue group if it has one), an error saying which is missing
// otherwise.
func routes(from *server.Server, id, subject string) error {
	rz, err := from.Routez(&server.RoutezOptions{Subscriptions: true})
	if err != nil {
		return fmt.Errorf("routez: %w", err)
	}
	for _, r := range rz.Routes {
		if r.RemoteID != id {
			continue
		}
		for _, sub := range r.Subs {
			if f := strings.Fields(sub); len(f) > 0 && server.SubjectMatchesFilter(subject, f[0]) {
				return nil
			}
		}
	}
	return fmt.Errorf("no route from %s carries interest in %s yet", id, subject)
}

// Stop shuts server i down and waits for it; its store stays, so Restart
// brings it back with its JetStream state.
func (c *Cluster) Stop(i int) {
	c.t.Helper()
	require.NoError(c.t, c.Cluster.Stop(i))
}

// Restart starts a stopped server i again on its ports and store, routed
// to every other server, and waits until the cluster is formed again.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	require.NoError(c.t, c.Cluster.Restart(i))
	c.WaitFormed()
}

// RoutedCluster is a Cluster whose routes run through links (Link), one
// per server and direction, so a test can cut a server off from the others
// (a network partition) while its clients stay connected to it.
type RoutedCluster struct {
	*Cluster
	links map[[2]int]*Link // from, to
}

// NATSClusterWithRouteLinks is NATSCluster with every route through a
// Link.
func NATSClusterWithRouteLinks(t *testing.T, n int) *RoutedCluster {
	t.Helper()
	rc := &RoutedCluster{}
	rc.Cluster = natsCluster(t, n, func(from, to int, addr string) string {
		if rc.links == nil { // a start retried on new ports makes new links
			rc.links = map[[2]int]*Link{}
		}
		l := NewLink(t, addr)
		rc.links[[2]int{from, to}] = l
		return l.Addr
	})
	return rc
}

// Isolate cuts every route to and from server i: it goes on serving its
// clients, which reach none of the other servers' clients nor the
// JetStream peers there.
func (c *RoutedCluster) Isolate(i int) { c.cut(touching(i)) }

// Heal restores server i's routes and waits until the cluster is formed
// again (a server retries a cut route about every second).
func (c *RoutedCluster) Heal(i int) {
	c.t.Helper()
	c.restore(touching(i))
}

// CutBetween cuts the routes between servers i and j alone (a partial
// partition): each still routes to every other server, but NATS routes do
// not relay, so clients of i and of j no longer reach each other.
func (c *RoutedCluster) CutBetween(i, j int) { c.cut(between(i, j)) }

// HealBetween restores the routes CutBetween cut and waits until the
// cluster is formed again.
func (c *RoutedCluster) HealBetween(i, j int) {
	c.t.Helper()
	c.restore(between(i, j))
}

// touching matches the routes to and from server i; between those of
// servers i and j (a route is keyed by its two servers, from and to).
func touching(i int) func([2]int) bool { return func(k [2]int) bool { return k[0] == i || k[1] == i } }

func between(i, j int) func([2]int) bool {
	return func(k [2]int) bool { return k == [2]int{i, j} || k == [2]int{j, i} }
}

func (c *RoutedCluster) cut(match func([2]int) bool) {
	for k, l := range c.links {
		if match(k) {
			l.Cut()
		}
	}
}

func (c *RoutedCluster) restore(match func([2]int) bool) {
	c.t.Helper()
	for k, l := range c.links {
		if match(k) {
			l.Restore()
		}
	}
	c.WaitFormed()
}
