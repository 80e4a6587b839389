package client

import (
	"slices"
	"time"
)

// Which boot of the session's node is alive (PROTOCOL.md step 14).
//
// A message of the node naming another boot is a restart only if that boot
// is newer than the registered one. A reply to a request sent after the
// current registration took effect proves it: only a live process answers,
// the registered boot was alive when it answered the register, and a node
// id runs one process at a time, so the answering boot started after it.
// Anything else (a hello, node heartbeat or resync, or a reply to an
// earlier request) may come from an older process and be delivered late (a
// NATS route; handlers of different subscriptions run apart): it is only a
// suspicion, put to the next probe, a heartbeat or register sent after it
// was received. If the registered boot answers, the suspect is older (its
// message was sent before that answer): a past boot. If another boot
// answers, that proves the restart. If nothing answers, the lease rule
// alone decides. So nothing is freed early while the registered boot can
// still copy.

const (
	// maxPastBoots bounds Client.pastBoots, maxSuspects Client.suspects. A
	// boot dropped from either costs a probe (a round trip) when it is seen
	// again, never a node loss.
	maxPastBoots = 4
	maxSuspects  = 8
)

// probeLocked numbers a request about to be sent whose reply may prove
// which boot is alive (repliedLocked).
func (c *Client) probeLocked() uint64 {
	c.probes++
	return c.probes
}

// seenLocked records an unsolicited message of node/boot (hello, node
// heartbeat, resync): of the registered boot it refreshes the lease;
// another boot not registered past is a suspicion (suspectLocked).
func (c *Client) seenLocked(node, boot string) {
	if node == "" || node != c.node || boot == "" || c.isPastBoot(boot) {
		return
	}
	if boot == c.boot {
		if !c.lost {
			c.lastSeen = time.Now()
		}
		return
	}
	c.suspectLocked(boot)
}

// suspectLocked notes boot, seen before every probe numbered above the
// current count, and wakes the loop to probe (a heartbeat; a register
// while the node is lost).
func (c *Client) suspectLocked(boot string) {
	if _, ok := c.suspects[boot]; !ok && len(c.suspects) < maxSuspects {
		if c.suspects == nil {
			c.suspects = map[string]uint64{}
		}
		c.suspects[boot] = c.probes
		c.st.BootsSuspected++
		c.cfg.Log.Info("client: another boot of the node seen; probing", "engine", c.cfg.Engine, "node", c.node,
			"boot", c.boot, "seen", boot)
	}
	c.wake()
}

// repliedLocked records the reply of node/boot to probe n.
func (c *Client) repliedLocked(node, boot string, n uint64) {
	if node == "" || node != c.node || boot == "" || c.isPastBoot(boot) {
		return
	}
	if boot == c.boot {
		if !c.lost {
			c.lastSeen = time.Now()
		}
		c.pastSuspectsLocked(n, "")
		return
	}
	if n <= c.regAt {
		// Sent before the registration: its answerer may be older.
		c.suspectLocked(boot)
		return
	}
	delete(c.suspects, boot)
	c.otherBoot = true
	if !c.lost {
		c.loseLocked("new boot " + boot)
	}
	c.wake() // a new boot is up: register as soon as the fence allows
}

// pastSuspectsLocked makes every boot suspected before probe n was sent a
// past boot, but alive: a boot of node newer than those answered n.
func (c *Client) pastSuspectsLocked(n uint64, alive string) {
	for b, at := range c.suspects {
		switch {
		case b == alive:
			delete(c.suspects, b)
		case at < n:
			delete(c.suspects, b)
			c.pastBoots = addPastBoot(c.pastBoots, b)
			c.st.BootsStale++
		}
	}
}

// pastBoots returns past with the session's boot added when a register
// reply names a later boot of the same node; another node has none.
func pastBoots(past []string, node, boot, repNode, repBoot string) []string {
	if repNode != node {
		return nil
	}
	// A past boot that answers is alive after all (a process must not share
	// a node id, but if one did, its messages are news again).
	past = slices.DeleteFunc(past, func(b string) bool { return b == repBoot })
	if boot == "" || repBoot == boot {
		return past
	}
	return addPastBoot(past, boot)
}

// addPastBoot adds boot to past, dropping the oldest beyond maxPastBoots.
func addPastBoot(past []string, boot string) []string {
	if slices.Contains(past, boot) {
		return past
	}
	if len(past) == maxPastBoots {
		past = append(past[:0], past[1:]...)
	}
	return append(past, boot)
}

// isPastBoot reports whether boot is one of node's known to be gone: one
// the engine registered past, or one older than a boot that answered.
func (c *Client) isPastBoot(boot string) bool { return slices.Contains(c.pastBoots, boot) }
