package client

import "time"

// SetBeforeHeartbeat sets a hook run just before each heartbeat is
// published, where the session loop would yield to a concurrent resync.
func SetBeforeHeartbeat(c *Client, f func()) {
	c.mu.Lock()
	c.beforeHeartbeat = f
	c.mu.Unlock()
}

// SetBeforeLoad sets a hook run in Load where another goroutine may run
// before the load is checked against a loss and sent.
func SetBeforeLoad(c *Client, f func()) {
	c.mu.Lock()
	c.beforeLoad = f
	c.mu.Unlock()
}

// SetAfterReregister sets a hook run on the session loop just after a
// re-register took effect (c.mu not held), before the loop goes on.
func SetAfterReregister(c *Client, f func()) {
	c.mu.Lock()
	c.afterReregister = f
	c.mu.Unlock()
}

// PastBoots is pastBoots, for its table test.
var PastBoots = pastBoots

// NoteSend records a publish to the node now, as if one had just been
// sent (the node_lost frees wait a lease from it).
func NoteSend(c *Client) {
	c.sent.end(c.sent.begin(time.Now()), nil)
}
