package sched

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// FuzzRequestStep decodes arbitrary bytes into a sequence of events of any
// type with any fields (negative and huge values, wrong request ids, holes,
// conflicts, out-of-range groups and block ids), copy completions and resets,
// applied with Step/Advance/JobDone against a small pool. PROTOCOL.md: a bad
// event "rejects that event ... and changes nothing"; "The cursor never
// decreases". Nothing may panic.
func FuzzRequestStep(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0})
	// hashes, blocks, tokens, advance, job done, finished.
	f.Add([]byte{3, 1, 0, 0, 4, 2, 1, 0, 4, 1, 2, 3, 4, 3, 1, 16, 1, 16, 7, 8, 0, 6, 0, 1, 16, 1, 16, 7})
	// preempted, blocks while preempted, resumed, reset.
	f.Add([]byte{5, 2, 0, 0, 4, 2, 3, 4, 5, 6, 4, 1, 9, 5, 1, 6, 9, 8, 1})
	// negative and huge fields.
	f.Add([]byte{1, 2, 1, 3, 2, 4, 3, 200, 2, 1, 255, 255, 255, 255, 3, 2, 250, 0, 0, 0, 0, 3, 3})
	rng := rand.New(rand.NewSource(7))
	for range 16 {
		b := make([]byte, 32+rng.Intn(96))
		rng.Read(b)
		f.Add(b)
	}
	layouts := []*Layout{
		layout(f, 2, 2, full(2), swa(4, 8), eagle(2)),
		layout(f, 4, 1, full(4)),
		layout(f, 1, 3, full(1), full(2)),
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		d := &fuzzData{b: data}
		lay := layouts[int(d.byte())%len(layouts)]
		pool := poolOf(lay, int(d.byte()%8))
		add := added(int(d.byte()))
		if d.byte()%2 == 0 {
			add.MaxOffloadTokens = d.int()
		}
		r := NewRequest(lay, add)
		jobs := map[JobID]*StoreJob{}
		var ids []JobID
		cursors := make([]messages.ChunkIndex, len(lay.Groups))
		handle := func(e Effects) {
			if j := e.Job; j != nil {
				require.NotContains(t, jobs, j.ID)
				for _, c := range j.Chunks {
					require.Len(t, c.Blocks, lay.BlocksPerChunk)
					require.NotZero(t, c.Blocks[len(c.Blocks)-1], "a chunk with a null last block is never stored")
					if lay.Groups[c.Group].Kind != KindFull {
						require.NotContains(t, c.Blocks, messages.BlockID(0),
							"a chunk of a group that is not full attention with a null block is never stored")
					}
				}
				jobs[j.ID] = j
				ids = append(ids, j.ID)
			}
			s := r.Snapshot()
			for g, gs := range s.Groups {
				require.GreaterOrEqual(t, gs.Cursor, cursors[g], "group %d cursor never decreases", g)
				cursors[g] = gs.Cursor
			}
			require.Equal(t, len(jobs), len(s.InFlight))
			pending := 0
			for _, j := range jobs {
				pending += len(j.Chunks)
			}
			require.Equal(t, pending, pool.Stats().Pending)
		}
		for steps := 0; !d.empty() && steps < 400; steps++ {
			switch op := d.byte() % 11; op {
			case 7:
				handle(r.Advance(pool))
			case 8, 9: // a copy ends: ok, failed or cancelled; or an unknown job
				if len(ids) == 0 {
					handle(r.JobDone(JobID(d.byte()), d.byte()%2 == 0, false))
					continue
				}
				i := int(d.byte()) % len(ids)
				id := ids[i]
				ids = append(ids[:i], ids[i+1:]...)
				mode := d.byte() % 3
				pool.CompleteStore(jobs[id].Keys(), sumsIf(jobs[id].Keys(), mode == 0))
				delete(jobs, id)
				handle(r.JobDone(id, mode == 0, mode == 2))
			case 10:
				if d.byte()%4 == 0 {
					handle(r.Reset(messages.ReasonEngineReset))
				}
			default:
				ev := d.event(messages.EventType(op + 1))
				before := r.Snapshot()
				if err := r.Step(ev); err != nil {
					require.Equal(t, before, r.Snapshot(), "rejected %v (%v) changes nothing", ev.Type, err)
					continue
				}
				handle(r.Advance(pool))
			}
		}
	})
}

// fuzzData reads fuzz bytes as values; past the end every read is zero.
type fuzzData struct{ b []byte }

func (d *fuzzData) empty() bool { return len(d.b) == 0 }

func (d *fuzzData) byte() byte {
	if len(d.b) == 0 {
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

// int is mostly small, sometimes negative, huge or any 32-bit value.
func (d *fuzzData) int() int {
	switch c := d.byte(); {
	case c < 200:
		return int(c % 64)
	case c < 220:
		return -int(c-199) * 3
	case c < 230:
		return []int{math.MaxInt, math.MinInt, math.MaxInt32, 1 << 40}[c%4]
	default:
		return int(int32(uint32(d.byte())<<24 | uint32(d.byte())<<16 | uint32(d.byte())<<8 | uint32(d.byte())))
	}
}

func (d *fuzzData) event(typ messages.EventType) *messages.Event {
	ev := &messages.Event{Type: typ, Request: rid}
	if d.byte()%16 == 0 {
		ev.Request = "r2"
	}
	switch typ {
	case messages.EvAdded:
		ev.PromptTokens = d.int()
		ev.MaxOffloadTokens = d.int()
	case messages.EvHashes:
		ev.Start = d.int()
		n := int(d.byte() % 8)
		for i := range n {
			h := hash(ev.Start + i) // usually the true prefix hash, so overlaps agree
			if d.byte()%8 == 0 {
				h = hash(int(d.byte()))
			}
			ev.Hashes = append(ev.Hashes, h)
		}
	case messages.EvBlocks:
		ev.Group = d.int() % 4
		ev.Start = d.int()
		n := int(d.byte() % 8)
		for range n {
			c := d.byte()
			switch {
			case c < 16:
				ev.IDs = append(ev.IDs, 0) // null
			case c < 240:
				ev.IDs = append(ev.IDs, messages.BlockID(c%64))
			default:
				ev.IDs = append(ev.IDs, messages.BlockID(math.MaxUint32-uint32(c)))
			}
		}
	case messages.EvTokens, messages.EvFinished:
		ev.Computed = d.int()
		ev.Total = d.int()
		ev.Aborted = d.byte()%2 == 0
	}
	return ev
}
