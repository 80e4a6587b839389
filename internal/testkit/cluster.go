package testkit

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// clusterFormTimeout bounds the wait for routes and a JetStream meta leader:
// a fresh 3-server cluster elects one in about a second on loopback.
const clusterFormTimeout = 20 * time.Second

// Cluster is a NATS cluster of embedded servers on 127.0.0.1, each with
// JetStream and its own store, routed to each other (nats-server's
// createJetStreamClusterExplicit, as a library). Servers are numbered from 0.
// Its methods may be called from the test goroutine only.
type Cluster struct {
	t       testing.TB
	name    string
	mu      sync.Mutex // guards servers against the clean-up running beside a stop
	servers []*server.Server
	opts    []*server.Options
}

// NATSCluster starts an n-server NATS cluster (n ≥ 2; 3 is the usual) and
// waits until every server is routed to the others and JetStream has a meta
// leader that counts all n peers. Every server is shut down when the test
// ends.
func NATSCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	require.GreaterOrEqual(t, n, 2, "clustered JetStream needs routes: two servers at least")
	c := &Cluster{t: t, name: "kvactors-test", servers: make([]*server.Server, n), opts: make([]*server.Options, n)}
	// Clustered JetStream wants every server's routes configured up front,
	// so the route ports are chosen before any server starts: freed loopback
	// ports, taken again by the servers at once (the usual test-port race,
	// narrow on loopback).
	routePorts := freePorts(t, n)
	for i := range n {
		c.opts[i] = &server.Options{
			ServerName: fmt.Sprintf("s%d", i),
			Host:       "127.0.0.1", // never listen beyond loopback in a test
			Port:       server.RANDOM_PORT,
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoLog:      true,
			NoSigs:     true,
			Cluster: server.ClusterOpts{
				Name: c.name,
				Host: "127.0.0.1",
				Port: routePorts[i],
			},
		}
	}
	for i, o := range c.opts {
		o.Routes = c.routesFrom(i)
	}
	// After the TempDirs: clean-ups run last-in first-out, so the servers
	// stop before their stores are removed.
	t.Cleanup(c.shutdown)
	for i, o := range c.opts {
		c.start(i)
		// Pin the client port actually bound, so a restart comes back where
		// the clients' server lists expect it.
		o.Port = c.servers[i].Addr().(*net.TCPAddr).Port
	}
	c.WaitFormed()
	return c
}

// routesFrom is the route list of server i: every other server.
func (c *Cluster) routesFrom(i int) []*url.URL {
	var routes []*url.URL
	for j, o := range c.opts {
		if j != i {
			routes = append(routes, &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", o.Cluster.Port)})
		}
	}
	return routes
}

// freePorts returns n loopback TCP ports that were free a moment ago.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, n)
	ls := make([]net.Listener, n)
	for i := range ls {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err, "reserve a loopback port")
		ls[i], ports[i] = l, l.Addr().(*net.TCPAddr).Port
	}
	for _, l := range ls {
		_ = l.Close()
	}
	return ports
}

// start creates and starts server i from its options and waits for it to
// accept clients.
func (c *Cluster) start(i int) {
	t := c.t
	t.Helper()
	o := c.opts[i].Clone()
	switch os.Getenv("NATS_LOGGING") {
	case "debug":
		o.NoLog, o.Debug = false, true
	case "trace":
		o.NoLog, o.Debug, o.Trace = false, true, true
	}
	s, err := server.NewServer(o)
	require.NoError(t, err, "create NATS server %d", i)
	s.ConfigureLogger()
	c.mu.Lock()
	c.servers[i] = s
	c.mu.Unlock()
	go s.Start() // a clustered JetStream server may block in Start until it meets its peers
	if !s.ReadyForConnections(readyTimeout) {
		t.Fatalf("NATS server %d not ready for connections after %v", i, readyTimeout)
	}
}

func (c *Cluster) shutdown() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.servers {
		if s != nil {
			s.Shutdown()
			s.WaitForShutdown()
			c.servers[i] = nil
		}
	}
}

// WaitFormed waits until every running server sees all the others over
// routes and JetStream has one meta leader that counts every configured
// server as a peer and every running server is current with it.
func (c *Cluster) WaitFormed() {
	c.t.Helper()
	Eventually(c.t, clusterFormTimeout, 20*time.Millisecond, c.formed)
}

func (c *Cluster) formed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	running, leaders := 0, 0
	for _, s := range c.servers {
		if s != nil {
			running++
		}
	}
	for i, s := range c.servers {
		if s == nil {
			continue
		}
		// NumRoutes counts pooled connections; what matters is one per peer.
		if rz, err := s.Routez(nil); err != nil || distinctRemotes(rz) < running-1 {
			return fmt.Errorf("server %d is routed to fewer than %d others", i, running-1)
		}
		if s.JetStreamIsLeader() {
			leaders++
			if p := s.JetStreamClusterPeers(); len(p) != len(c.servers) {
				return fmt.Errorf("meta leader s%d counts %d peers, want %d", i, len(p), len(c.servers))
			}
		}
		if !s.JetStreamIsCurrent() {
			return fmt.Errorf("server %d is not current with the JetStream meta group", i)
		}
	}
	if leaders != 1 {
		return fmt.Errorf("%d JetStream meta leaders, want 1", leaders)
	}
	return nil
}

func distinctRemotes(rz *server.Routez) int {
	seen := map[string]bool{}
	for _, r := range rz.Routes {
		seen[r.RemoteID] = true
	}
	return len(seen)
}

// Server returns server i, or nil while it is stopped.
func (c *Cluster) Server(i int) *server.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.servers[i]
}

// URL is the client URL of server i (stable across a restart).
func (c *Cluster) URL(i int) string {
	return fmt.Sprintf("nats://127.0.0.1:%d", c.opts[i].Port)
}

// URLs is every server's client URL, comma-separated, server i first, as
// nats.Connect takes them: a client that loses server i fails over to the
// others.
func (c *Cluster) URLs(i int) string {
	urls := []string{c.URL(i)}
	for j := range c.opts {
		if j != i {
			urls = append(urls, c.URL(j))
		}
	}
	return strings.Join(urls, ",")
}

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

// Stop shuts server i down and waits for it; its store stays, so Restart
// brings it back with its JetStream state.
func (c *Cluster) Stop(i int) {
	c.t.Helper()
	c.mu.Lock()
	s := c.servers[i]
	c.servers[i] = nil
	c.mu.Unlock()
	if s == nil {
		c.t.Fatalf("stop server %d: not running", i)
	}
	s.Shutdown()
	s.WaitForShutdown()
}

// Restart starts a stopped server i again on its ports and store, routed
// to every other server, and waits until the cluster is formed again.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if c.Server(i) != nil {
		c.t.Fatalf("restart server %d: still running", i)
	}
	c.start(i)
	c.WaitFormed()
}
