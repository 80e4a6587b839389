package engine

import "sync"

// trailEpochs is how many epochs an EpochTrail keeps: an actor's
// Sequencer takes in its predecessor's live epoch and the four that ended
// before it (sched.Sequencer.Inherit).
const trailEpochs = 5

// EpochTrail is the epochs an engine's actors began, newest first. A node
// keeps one per engine id for the whole boot and hands it to each actor of
// the engine: a later actor (a re-register) takes them into its Sequencer,
// so a late message of an epoch its predecessor had is not a new epoch
// there (sched.Sequencer.Inherit). Safe for concurrent use (an actor
// retiring may still begin one as the next starts).
type EpochTrail struct {
	mu     sync.Mutex
	recent []string
}

// began records epoch as the newest, if it is not already.
func (t *EpochTrail) began(epoch string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.recent) > 0 && t.recent[0] == epoch {
		return
	}
	if len(t.recent) < trailEpochs {
		t.recent = append(t.recent, "")
	}
	copy(t.recent[1:], t.recent)
	t.recent[0] = epoch
}

// Recent is the epochs, newest first.
func (t *EpochTrail) Recent() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.recent...)
}
