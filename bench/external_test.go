package bench

import (
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"
)

// The command name in /proc/<pid>/stat may hold spaces and ')': fields
// count from the last ')'.
func TestParseStatCPU(t *testing.T) {
	stat := "4242 (kv act)ors) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 75 0 0 20 0 9 0 100 1000 200\n"
	got, err := parseStatCPU([]byte(stat))
	require.NoError(t, err)
	require.InDelta(t, 3.25, got, 1e-9)

	for _, bad := range []string{"", "4242 (x S 1", "4242 (x) S 1 2", "4242 (x) S 1 4242 4242 0 -1 1 1 0 0 0 u 75"} {
		_, err := parseStatCPU([]byte(bad))
		require.Error(t, err, "%q", bad)
	}
}

// The burst's goroutine goal depends on its engines, never its requests:
// 4 engines may use 96 goroutines, a burst that left a goroutine per
// waiting request fails, and no sample is not a pass.
func TestBurstGoroutineGoal(t *testing.T) {
	goal := func(peak float64) Goal {
		r := Report{Burst: &ExternalBurst{Requests: 100_000, Released: 100_000, Engines: 4, PoolBytes: 16 << 20,
			NodePeakAnonBytes: 100 << 20, NodePeakGoroutines: peak}}
		r.goals()
		for _, g := range r.Goals {
			if strings.HasPrefix(g.Name, "external burst: node goroutines") {
				return g
			}
		}
		t.Fatalf("no goroutine goal in %+v", r.Goals)
		return Goal{}
	}
	require.True(t, goal(44).Pass)
	require.True(t, goal(96).Pass)
	require.False(t, goal(299).Pass, "a slow run of the AfterFunc retries")
	require.False(t, goal(0).Pass)
	require.Equal(t, "<= 96", goal(1).Target)
}

// The burst's memory goal is the pool plus the child's peak RssAnon, not
// its VmHWM (which also counts the engines' segment pages it copied from):
// a small anon peak passes whatever the high-water mark, a large one fails.
func TestBurstMemoryGoalIsPoolPlusAnon(t *testing.T) {
	goalOf := func(requests int, anon, hwm int64) Goal {
		r := Report{Burst: &ExternalBurst{Requests: requests, Released: requests, PoolBytes: 16 << 20, Engines: 4,
			NodePeakAnonBytes: anon, NodeMaxRSSBytes: hwm}}
		r.goals()
		for _, g := range r.Goals {
			if g.Name == "external burst: node memory (pool + peak anon)" {
				return g
			}
		}
		t.Fatalf("no memory goal in %+v", r.Goals)
		return Goal{}
	}
	goal := func(anon, hwm int64) Goal { return goalOf(10, anon, hwm) }
	g := goal(100<<20, 2<<30)
	require.True(t, g.Pass, "100 MiB anon passes, a 2 GiB VmHWM notwithstanding")
	require.InDelta(t, 116.0, g.Value, 1e-9, "pool + anon, in MiB")
	require.False(t, goal(257<<20, 0).Pass, "past pool + 256 MiB fails")
	require.False(t, goal(0, 0).Pass, "no sample is not a pass")
	require.Equal(t, "<= 272.0 MiB", goalOf(GoalBurstRequests, 1, 0).Target, "issue 14's 40k burst: pool + 256 MiB")

	// Past 40k requests the bound grows by the heap goal per live request:
	// 100k into a 16 MiB pool may use 16 + 256 + 60,000 × 1.5 KB ≈ 359.9 MiB.
	require.True(t, goalOf(100_000, 300<<20, 0).Pass)
	require.False(t, goalOf(100_000, 344<<20, 0).Pass, "16 + 344 MiB is past 359.9")
	require.Equal(t, "<= 359.9 MiB", goalOf(100_000, 1, 0).Target)
}

// unitCosts recovers the per-chunk and per-job costs that made two mixes'
// CPU, whatever they are, when the mixes' chunks per job differ enough; when
// they do not, or a mix stored nothing, it gives no figure.
func TestUnitCostsSplitChunksFromJobs(t *testing.T) {
	prop := func(chunkNS, jobNS uint16, jobsA, jobsB uint16, perJobA, perJobB uint8) bool {
		chunkUS, jobUS := float64(chunkNS)/1000, float64(jobNS)/1000
		ja, jb := int(jobsA)+1, int(jobsB)+1
		ka, kb := ja*(int(perJobA%4)+1), jb*(int(perJobB%8)+9) // 1..4 and 9..16 chunks per job
		mix := func(chunks, jobs int) storeMix {
			return storeMix{cpu: (chunkUS*float64(chunks) + jobUS*float64(jobs)) / 1e6, chunks: chunks, jobs: jobs}
		}
		c, j := unitCosts(mix(ka, ja), mix(kb, jb))
		return math.Abs(c-chunkUS) < 1e-6 && math.Abs(j-jobUS) < 1e-6
	}
	require.NoError(t, quick.Check(prop, nil))

	same := storeMix{cpu: 1, chunks: 500, jobs: 100}
	c, j := unitCosts(same, storeMix{cpu: 2, chunks: 1050, jobs: 200})
	require.Zero(t, c, "5 and 5.25 chunks per job cannot be told apart")
	require.Zero(t, j)
	c, j = unitCosts(same, storeMix{})
	require.Zero(t, c, "a mix that stored nothing")
	require.Zero(t, j)
	// 5 and 2 chunks per job, but the narrow mix's CPU came out too low: a
	// negative job cost would follow. No figure.
	c, j = unitCosts(same, storeMix{cpu: 0.3, chunks: 200, jobs: 100})
	require.Zero(t, c, "noise, not a negative cost")
	require.Zero(t, j)
}

// The all-in goal is the two unit goals at the store-heavy mix's own
// chunks per job: 5 chunks per job allow 0.5 + 1/5 µs per chunk. Unit costs
// that meet both goals meet it (what storing adds per chunk is the solve's
// chunk cost plus its job cost per chunk); a mix that stored nothing gives
// no such goal.
func TestAllInStoreGoalIsTheUnitGoalsAtTheMixsChunksPerJob(t *testing.T) {
	goal := func(e External) (Goal, bool) {
		r := Report{External: &e}
		r.goals()
		for _, g := range r.Goals {
			if g.Name == "external: storing adds per chunk, all in" {
				return g, true
			}
		}
		return Goal{}, false
	}
	g, ok := goal(External{StoredChunks: 5000, StoreJobs: 1000, StoreUSPerChunk: 0.69})
	require.True(t, ok)
	require.Equal(t, "<= 0.70 µs", g.Target)
	require.True(t, g.Pass)
	g, _ = goal(External{StoredChunks: 5000, StoreJobs: 1000, StoreUSPerChunk: 2.6})
	require.False(t, g.Pass, "today's 2.6 µs per chunk")
	_, ok = goal(External{})
	require.False(t, ok, "nothing stored: no all-in goal")

	prop := func(chunkNS, jobNS uint16, jobs uint16, perJob uint8) bool {
		chunkUS, jobUS := float64(chunkNS)/1000, float64(jobNS)/1000
		j := int(jobs) + 1
		k := j * (int(perJob%16) + 1)
		e := External{StoredChunks: k, StoreJobs: j, StoreUSPerChunk: chunkUS + jobUS*float64(j)/float64(k)}
		g, ok := goal(e)
		meetsBoth := chunkUS <= GoalExternalUSPerChunk && jobUS <= GoalExternalUSPerJob
		return ok && (!meetsBoth || g.Pass)
	}
	require.NoError(t, quick.Check(prop, nil))
}

// Replies to the three mixes' engines are counted apart by engine id.
func TestOutcomeTellsMixesApart(t *testing.T) {
	o := outcome{prefix: "kvactors"}
	require.Same(t, &o.noStore, o.of("kvactors."+noStorePrefix+"e0.released"))
	require.Same(t, &o.narrow, o.of("kvactors."+narrowPrefix+"e1.stored"))
	require.Same(t, &o.heavy, o.of("kvactors.e2.stored"))
	require.Same(t, &o.heavy, o.of("kvactors.l50e0.stored"))
}

// The counters come from /proc: this process's own grow as it works, and
// a file missing a field is an error, not a zero.
func TestProcCounters(t *testing.T) {
	a, err := readProcCounters(os.Getpid())
	require.NoError(t, err)
	for range 50 {
		_, err := os.ReadFile("/proc/self/stat")
		require.NoError(t, err)
	}
	b, err := readProcCounters(os.Getpid())
	require.NoError(t, err)
	require.GreaterOrEqual(t, b.minus(a).Syscalls, int64(50))

	v, err := procValues([]byte("syscr: 7\nwchar: 9\nsyscw: 5\n"), "syscr", "syscw")
	require.NoError(t, err)
	require.Equal(t, []int64{7, 5}, v)
	kb, err := procValues([]byte("VmHWM:\t  2048 kB\nRssAnon:\t 1024 kB\n"), "VmHWM", "RssAnon")
	require.NoError(t, err)
	require.Equal(t, []int64{2048, 1024}, kb, "status values in kB")
	_, err = procValues([]byte("syscr: 7\n"), "syscr", "syscw")
	require.Error(t, err)
	_, err = procValues([]byte("syscr: x\nsyscw: 5\n"), "syscr", "syscw")
	require.Error(t, err)

	// The child's memory comes through the same reader.
	self := &child{cmd: &exec.Cmd{Process: &os.Process{Pid: os.Getpid()}}}
	m := self.memory()
	require.Positive(t, m.HWM)
	require.Positive(t, m.Anon)
	require.GreaterOrEqual(t, m.HWM, m.Anon)
}
