package embedded

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// metaGroup is the name nats-server gives the JetStream meta group's Raft
// node (its defaultMetaGroupName).
const metaGroup = "_meta_"

// readyTimeout bounds the wait for one server to accept clients.
const readyTimeout = 10 * time.Second

// Options configure Start.
type Options struct {
	// Servers is the number of servers, at least 2 (clustered JetStream
	// needs routes); 3 tolerates the loss of one.
	Servers int
	// Dir holds the servers' stores, one subdirectory each (s0, s1, …).
	Dir string
	// Name is the cluster name (default "kvactors").
	Name string
	// Debug and Trace turn on the servers' logs (default silent).
	Debug, Trace bool
	// RouteVia, when set, is the address server from dials to reach the
	// route port addr of server to: a test puts a proxy there to cut the
	// route. Each server then advertises a route address held refused for
	// the cluster's life, so none learns another's real port by gossip and
	// dials past the proxy (an implicit route, which a cut would miss).
	RouteVia func(from, to int, addr string) string
}

// Cluster is a running embedded cluster. Safe for concurrent use.
type Cluster struct {
	mu      sync.Mutex
	servers []*server.Server // nil while stopped
	opts    []*server.Options
	nowhere *nowhere // the advertised route address under RouteVia
}

// ErrNotFormed is wrapped by Formed's answer while the cluster is forming.
var ErrNotFormed = errors.New("NATS cluster not formed")

// Start starts the servers and returns once each accepts clients; call
// WaitFormed before using JetStream. Close stops them.
func Start(o Options) (*Cluster, error) {
	if o.Servers < 2 {
		return nil, fmt.Errorf("embedded NATS cluster of %d servers: need 2 or more", o.Servers)
	}
	if o.Dir == "" {
		return nil, errors.New("embedded NATS cluster: no store directory")
	}
	if o.Name == "" {
		o.Name = "kvactors"
	}
	// Clustered JetStream wants every server's routes configured up front,
	// so the route ports are chosen before any server starts: loopback
	// ports freed a moment before the servers take them. Another process
	// (or a parallel test) may take one in that moment; the server then
	// never becomes ready, and the whole cluster is started again on new
	// ports, in a fresh store directory.
	var err error
	for attempt := range startAttempts {
		var c *Cluster
		c, err = start(o, filepath.Join(o.Dir, fmt.Sprintf("try%d", attempt)))
		if err == nil {
			return c, nil
		}
	}
	return nil, err
}

// startAttempts bounds Start's retries after a lost route-port race.
const startAttempts = 3

func start(o Options, dir string) (*Cluster, error) {
	routePorts, err := freePorts(o.Servers)
	if err != nil {
		return nil, err
	}
	c := &Cluster{servers: make([]*server.Server, o.Servers), opts: make([]*server.Options, o.Servers)}
	for i := range o.Servers {
		c.opts[i] = &server.Options{
			ServerName: fmt.Sprintf("s%d", i),
			Host:       "127.0.0.1", // loopback only
			Port:       server.RANDOM_PORT,
			JetStream:  true,
			SyncAlways: true, // revisions fence owners: none may be issued twice (docs/CLUSTER.md)
			StoreDir:   filepath.Join(dir, fmt.Sprintf("s%d", i)),
			NoLog:      !o.Debug && !o.Trace,
			Debug:      o.Debug || o.Trace,
			Trace:      o.Trace,
			NoSigs:     true, // the process owns its signals
			Cluster:    server.ClusterOpts{Name: o.Name, Host: "127.0.0.1", Port: routePorts[i]},
		}
	}
	var advertise string // under RouteVia: a route address that refuses
	if o.RouteVia != nil {
		nw, err := reserveNowhere()
		if err != nil {
			return nil, err
		}
		c.nowhere, advertise = nw, fmt.Sprintf("127.0.0.1:%d", nw.port)
	}
	for i, so := range c.opts {
		so.Routes = c.routesFrom(i, o.RouteVia)
		so.Cluster.Advertise = advertise
	}
	for i, so := range c.opts {
		if err := c.start(i); err != nil {
			c.Close()
			return nil, err
		}
		// Pin the client port bound, so a restart comes back where the
		// clients' server lists expect it.
		so.Port = c.Server(i).Addr().(*net.TCPAddr).Port
	}
	return c, nil
}

// routesFrom is the route list of server i: every other server, through
// via when set.
func (c *Cluster) routesFrom(i int, via func(from, to int, addr string) string) []*url.URL {
	var routes []*url.URL
	for j, o := range c.opts {
		if j != i {
			addr := fmt.Sprintf("127.0.0.1:%d", o.Cluster.Port)
			if via != nil {
				addr = via(i, j, addr)
			}
			routes = append(routes, &url.URL{Scheme: "nats", Host: addr})
		}
	}
	return routes
}

func freePorts(n int) ([]int, error) {
	ports := make([]int, n)
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("reserve a loopback port: %w", err)
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}

// start creates server i from its options, starts it and waits until it
// accepts clients.
func (c *Cluster) start(i int) error {
	s, err := server.NewServer(c.opts[i].Clone())
	if err != nil {
		return fmt.Errorf("create NATS server s%d: %w", i, err)
	}
	s.ConfigureLogger()
	c.mu.Lock()
	c.servers[i] = s
	c.mu.Unlock()
	go s.Start() // a clustered JetStream server may block in Start until it meets its peers
	if !s.ReadyForConnections(readyTimeout) {
		return fmt.Errorf("NATS server s%d not ready for connections after %v", i, readyTimeout)
	}
	return nil
}

// Close shuts every running server down and waits for each, then frees
// the reserved route address (RouteVia). A second Close does nothing.
func (c *Cluster) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.servers {
		if s != nil {
			s.Shutdown()
			s.WaitForShutdown()
			c.servers[i] = nil
		}
	}
	if c.nowhere != nil {
		c.nowhere.release()
		c.nowhere = nil
	}
}

// Formed is nil once every running server is routed to the others and
// JetStream has one meta leader that counts every configured server as a
// peer, with every running server current; else it says what is missing.
func (c *Cluster) Formed() error {
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
			return fmt.Errorf("%w: s%d is routed to fewer than %d others", ErrNotFormed, i, running-1)
		}
		if s.JetStreamIsLeader() {
			leaders++
			if p := s.JetStreamClusterPeers(); len(p) != len(c.servers) {
				return fmt.Errorf("%w: meta leader s%d counts %d peers, want %d", ErrNotFormed, i, len(p), len(c.servers))
			}
		}
		if !s.JetStreamIsCurrent() {
			return fmt.Errorf("%w: s%d is not current with the JetStream meta group", ErrNotFormed, i)
		}
	}
	if leaders != 1 {
		return fmt.Errorf("%w: %d JetStream meta leaders, want 1", ErrNotFormed, leaders)
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

// WaitFormed polls Formed until it is nil or ctx ends (then Formed's last
// answer is the error).
func (c *Cluster) WaitFormed(ctx context.Context) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := c.Formed()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (%w); meta group: %s", err, ctx.Err(), c.metaGroups())
		case <-tick.C:
		}
	}
}

// metaGroups describes each running server's view of the JetStream meta
// group (its Raft state, term, leader, log positions and when it last heard
// each peer): what a cluster that does not form is stuck on.
func (c *Cluster) metaGroups() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for i, s := range c.servers {
		if s == nil {
			continue
		}
		if b.Len() > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "s%d %s", i, describeMeta(s))
	}
	return b.String()
}

func describeMeta(s *server.Server) string {
	st := s.Raftz(&server.RaftzOptions{GroupFilter: metaGroup})
	if st == nil {
		return "(no meta group)"
	}
	for _, groups := range *st {
		g, ok := groups[metaGroup]
		if !ok {
			continue
		}
		var b strings.Builder
		fmt.Fprintf(&b, "%s term %d vote %s leader %s commit %d applied %d pterm %d pindex %d",
			g.State, g.Term, nodeName(g, g.Vote), nodeName(g, g.Leader), g.Committed, g.Applied, g.PTerm, g.PIndex)
		if g.CatchingUp {
			b.WriteString(" catching up")
		}
		if g.Paused {
			b.WriteString(" paused")
		}
		if g.WALError != nil {
			fmt.Fprintf(&b, " wal error %v", g.WALError)
		}
		for _, p := range slices.SortedFunc(maps.Values(g.Peers), func(a, b server.RaftzGroupPeer) int {
			return strings.Compare(a.Name, b.Name)
		}) {
			if p.LastSeen == "" {
				fmt.Fprintf(&b, ", peer %s never seen", p.Name)
			} else {
				fmt.Fprintf(&b, ", peer %s seen %s ago", p.Name, p.LastSeen)
			}
		}
		return b.String()
	}
	return "(no meta group)"
}

// nodeName is the server name behind Raft node id, as g knows it: Raft
// speaks in node ids, the cluster's servers are named s0, s1, ….
func nodeName(g server.RaftzGroup, id string) string {
	switch {
	case id == "":
		return "none"
	case id == g.ID:
		return "self"
	}
	if p, ok := g.Peers[id]; ok && p.Name != "" {
		return p.Name
	}
	return id
}

// Size is the number of configured servers.
func (c *Cluster) Size() int { return len(c.opts) }

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
// nats.Connect takes them: a client that loses server i fails over.
func (c *Cluster) URLs(i int) string {
	urls := []string{c.URL(i)}
	for j := range c.opts {
		if j != i {
			urls = append(urls, c.URL(j))
		}
	}
	return strings.Join(urls, ",")
}

// Stop shuts server i down and waits; its store stays for Restart.
func (c *Cluster) Stop(i int) error {
	c.mu.Lock()
	s := c.servers[i]
	c.servers[i] = nil
	c.mu.Unlock()
	if s == nil {
		return fmt.Errorf("stop NATS server s%d: not running", i)
	}
	s.Shutdown()
	s.WaitForShutdown()
	return nil
}

// Restart starts a stopped server i again on its ports and store; call
// WaitFormed before relying on it.
func (c *Cluster) Restart(i int) error {
	if c.Server(i) != nil {
		return fmt.Errorf("restart NATS server s%d: still running", i)
	}
	return c.start(i)
}
