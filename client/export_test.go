package client

// SetBeforeHeartbeat sets a hook run just before each heartbeat is
// published, where the session loop would yield to a concurrent resync.
func SetBeforeHeartbeat(c *Client, f func()) {
	c.mu.Lock()
	c.beforeHeartbeat = f
	c.mu.Unlock()
}

// PastBoots is pastBoots, for its table test.
var PastBoots = pastBoots
