package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/fixtures"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/query"
	"github.com/novox/mesh-provisioner/store"
)

// outcomes counts what happened to the requests of a run.
type outcomes struct {
	mu          sync.Mutex
	answered    int               // 200
	waitEnded   int               // 504: a min_seq wait ended by the stop, answered
	noResponder int               // nobody took the request: sent after the verb stopped taking
	failed      []string          // timeouts (taken and never answered), other errors
	maxAsOf     map[string]uint64 // per what
}

func (o *outcomes) add(what string, code int, asOf uint64, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		o.noResponder++
	case err != nil:
		o.failed = append(o.failed, fmt.Sprintf("%s: %v", what, err))
	case code == 200:
		o.answered++
		if asOf > o.maxAsOf[what] {
			o.maxAsOf[what] = asOf
		}
	case code == 504:
		o.waitEnded++
	default:
		o.failed = append(o.failed, fmt.Sprintf("%s: code %d", what, code))
	}
}

// TestGraceful_SIGTERMUnderLoad stops a serving, ingesting seat with SIGTERM: it exits 0, every
// request it took is answered (waits for min_seq with a 504), the last batch is committed and synced
// so that no state an answer showed is lost, and a restart on the same state dir resumes from the
// checkpoint without a rebuild.
func TestGraceful_SIGTERMUnderLoad(t *testing.T) {
	url := runServer(t, "")
	nc, js := natstest.Connect(t, url)
	require.NoError(t, fixtures.Load(context.Background(), js, faultMesh.Ops(), 0, nil))
	state := t.TempDir()
	p := serve(t, url, state)
	waitAnswering(t, nc, 20*time.Second, p)
	waitRegistry(t, js, 10*time.Second)
	w := startWriter(t, js, newMix(7, 100), 200, 0)

	o := &outcomes{maxAsOf: map[string]uint64{}}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := 0; c < 8; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cnc, _ := natstest.Connect(t, url)
			r := rand.New(rand.NewPCG(uint64(c), 2))
			for {
				select {
				case <-stop:
					return
				default:
				}
				what := []string{"needs", "applied", "collect", "registry"}[r.IntN(4)]
				body := fmt.Sprintf(`{"what":%q,"node":"n%05d"}`, what, r.IntN(100))
				if what == "registry" {
					body = `{}`
				}
				if c <= 3 {
					// Heavy answers, so that some are still queued when the stop comes.
					body = fmt.Sprintf(`{"what":%q,"limit":10000}`, what)
				}
				if c == 0 {
					// A wait that only the stop ends: it must still be answered.
					body = fmt.Sprintf(`{"what":%q,"min_seq":999999999,"wait_ms":10000,"limit":1}`, what)
				}
				msg, err := cnc.Request(query.Subject, []byte(body), 15*time.Second)
				code, asOf := 0, uint64(0)
				if err == nil {
					code = 200
					if c := msg.Header.Get(micro.ErrorCodeHeader); c != "" {
						code, _ = strconv.Atoi(c)
					} else {
						asOf = asOfOf(string(msg.Data))
					}
				}
				o.add(what, code, asOf, err)
				if errors.Is(err, nats.ErrNoResponders) {
					return // the seat has stopped taking requests
				}
			}
		}()
	}
	natstest.CheckFor(t, 20*time.Second, 5*time.Millisecond, func() error {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.answered < 300 {
			return fmt.Errorf("%d answered", o.answered)
		}
		return nil
	})
	p.signal(syscall.SIGTERM)
	code, err := p.wait(30 * time.Second)
	require.NoError(t, err, p.tail())
	require.Equal(t, 0, code, p.tail())
	close(stop)
	wg.Wait()
	w.pause()
	require.Contains(t, p.logs(), "stopped cleanly")
	t.Logf("at SIGTERM: %d answered, %d min_seq waits answered 504 by the stop, %d asked after the verb stopped (no responders), %d failed",
		o.answered, o.waitEnded, o.noResponder, len(o.failed))
	require.Empty(t, o.failed, "every request the seat took is answered")
	require.Positive(t, o.waitEnded, "the waits in flight were answered")

	// Committed and synced: the state dir opens as it is and holds at least every as_of answered.
	db, err := store.OpenState(state, store.Options{})
	require.NoError(t, err, "the state dir opens without a rebuild")
	for what, seen := range o.maxAsOf {
		shape, _ := provisioner.ShapeOfWhat(provisioner.What(what))
		cp := db.Checkpoint(shape.Bucket)
		require.GreaterOrEqual(t, cp.Applied, seen, "%s: the checkpoint holds what was answered", what)
	}
	require.NoError(t, db.Close())

	// A restart resumes from the checkpoint: its very first answers are already at least as far.
	p2 := serve(t, url, state)
	waitAnswering(t, nc, 20*time.Second, p2)
	for what, seen := range o.maxAsOf {
		a, _, err := natstest.Ask(nc, query.Subject, []byte(`{"what":"`+what+`","limit":1}`), false)
		require.NoError(t, err)
		require.GreaterOrEqual(t, a.AsOf, seen, "%s resumes from its checkpoint", what)
	}
	checkEqual(t, nc, js, 30*time.Second)
	require.NotContains(t, strings.ToLower(p2.logs()), "rebuild", p2.tail())
}

// asOfOf reads as_of from a JSON answer without decoding its rows.
func asOfOf(body string) uint64 {
	i := strings.LastIndex(body, `"as_of":`)
	if i < 0 {
		return 0
	}
	rest := body[i+len(`"as_of":`):]
	j := strings.IndexAny(rest, ",}")
	n, _ := strconv.ParseUint(rest[:j], 10, 64)
	return n
}
