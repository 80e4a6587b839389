package node

import "github.com/nats-io/nats.go"

// Seams for node/cluster_catchup_test.go.

// WithNATSOptions appends opts to the node's NATS client options: e.g.
// nats.IgnoreDiscoveredServers, so a node behind a testkit.Link stays cut
// off when the link is cut instead of failing over to a server it learnt of.
func WithNATSOptions(opts ...nats.Option) func(*Config) {
	return func(c *Config) { c.natsExtra = append(c.natsExtra, opts...) }
}

// NATSStats returns the node's NATS connection's counters (messages and
// bytes received).
func (n *Node) NATSStats() nats.Statistics { return n.nc.Stats() }
