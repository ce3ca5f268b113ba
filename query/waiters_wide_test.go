package query

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/internal/natstest"
	"github.com/novox/mesh-provisioner/store"
)

// TestServer_WideWaitersLeaveRoomToNodeLookups: docs/decisions.md (Serving), the requests waiting for
// min_seq that no node narrows (a module polled across the mesh, a whole bucket) take at most half of
// the waiters' places and of their bytes. A flood of them waiting for a sequence far ahead, past
// either half, is answered 504 at once saying so, and a node's lookup with min_seq (a node client
// reading its own write) still waits, and is answered once its sequence comes. Before, the flood took
// every place (or every byte), and each node lookup with min_seq was answered 504 at once.
func TestServer_WideWaitersLeaveRoomToNodeLookups(t *testing.T) {
	const far = `"min_seq":1000000,"wait_ms":10000`
	wideOf := func(module string) []byte {
		return []byte(`{"what":"needs","module":"` + module + `",` + far + `}`)
	}
	node := []byte(`{"what":"needs","node":"n1","min_seq":2,"wait_ms":10000}`)

	t.Run("places", func(t *testing.T) {
		const places = 4
		s, nc, db := waitingServer(t, places)
		got, inbox := collect(t, nc)
		for i := 0; i < places; i++ {
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.w%d", inbox, i), wideOf("m")))
		}
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if w, c := s.Waiting(), got.get("504"); w+c != places {
				return fmt.Errorf("%d waiting, %d answered 504", w, c)
			}
			return nil
		})
		require.Equal(t, places/2, s.Waiting(), "wide requests waiting")
		// One more is told why it is not waiting.
		_, _, err := natstest.Ask(nc, Subject, wideOf("m"), false)
		var ve *natstest.VerbError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, 504, ve.Code)
		require.Equal(t, "timeout: min_seq 1000000 not reached (applied 1), and 2 requests not narrowed by node wait for theirs already, as many as this seat holds of them: ask again", ve.Description)

		// The node lookups wait in the other half, and are answered when their sequence comes.
		for i := 0; i < places/2; i++ {
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.n%d", inbox, i), node))
		}
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if w, c := s.Waiting(), got.get("504"); w+c != places+places/2 {
				return fmt.Errorf("%d waiting, %d answered 504", w, c)
			}
			return nil
		})
		require.Equal(t, places/2, got.get("504"), "node lookups answered 504 at once")
		putNeed(t, db, 2)
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if n := got.get("200"); n != places/2 {
				return fmt.Errorf("%d node lookups answered", n)
			}
			return nil
		})
		require.Equal(t, places/2, s.Waiting(), "the wide requests still wait")
	})

	t.Run("bytes", func(t *testing.T) {
		s, nc, _ := waitingServer(t, 0)
		got, inbox := collect(t, nc)
		waitingBytes := func() int {
			s.waitMu.Lock()
			defer s.waitMu.Unlock()
			return s.waitingBytes
		}
		i := 0
		send := func(body []byte) {
			t.Helper()
			i++
			waiting, timedOut := s.Waiting(), got.get("504")
			require.NoError(t, nc.PublishRequest(Subject, fmt.Sprintf("%s.%d", inbox, i), body))
			natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
				if s.Waiting() > waiting || got.get("504") > timedOut {
					return nil
				}
				return fmt.Errorf("request %d neither waits nor was answered 504", i)
			})
		}
		// Wide requests of 900 KiB of fields each until one is refused, then smaller ones to fill
		// what is left to the byte, until one of those is refused.
		const most = 900 << 10
		for got.get("504") == 0 {
			require.Less(t, i, 100, "the wide requests took every byte")
			send(wideOf(strings.Repeat("m", most)))
		}
		overhead := (&Request{What: "needs", MinSeq: 1, WaitMS: 1}).size()
		for refused := got.get("504"); got.get("504") == refused; {
			rest := maxWaitingBytes - waitingBytes() - overhead
			if rest <= 0 {
				break
			}
			send(wideOf(strings.Repeat("m", min(rest, most))))
		}

		// A node's lookup still waits.
		waiting, refused, wide := s.Waiting(), got.get("504"), waitingBytes()
		require.NoError(t, nc.PublishRequest(Subject, inbox+".node", node))
		natstest.CheckFor(t, 10*time.Second, 2*time.Millisecond, func() error {
			if s.Waiting() == waiting && got.get("504") == refused {
				return fmt.Errorf("the node lookup neither waits nor was answered")
			}
			return nil
		})
		require.Equal(t, refused, got.get("504"), "node lookup answered 504 with %d bytes of fields waiting", waitingBytes())
		require.Equal(t, waiting+1, s.Waiting())
		require.LessOrEqual(t, wide, maxWideWaitingBytes, "bytes of the wide requests waiting")
	})
}

// waitingServer serves a store holding need 1, synced, with two workers, no read-ahead and the given
// MaxWaiting (0: the default), on a nats-server of its own; it returns a client's connection.
func waitingServer(t *testing.T, maxWaiting int) (*Server, *nats.Conn, *store.DB) {
	t.Helper()
	db := smallStore(t)
	putNeed(t, db, 1)
	db.SetSynced(provisioner.BucketNeeds, true)
	ns := natstest.RunServer(t)
	snc, _ := natstest.Connect(t, ns.ClientURL())
	s := NewServer(StoreReader(db), Options{Workers: 2, NoReadAhead: true, MaxWaiting: maxWaiting})
	require.NoError(t, s.Start(snc, nil))
	t.Cleanup(s.Stop)
	nc, _ := natstest.Connect(t, ns.ClientURL())
	return s, nc, db
}
