package replay_test

import (
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

// TestLog_CloseWhileAsking: a Log closed while an Ask runs on another goroutine waits for it: the
// Ask answers, or says the log is closed, and never reads a closed store. An Ask after Close says
// the log is closed. (Close used to close the store under the Ask's open view: pebble panicked,
// "element has outstanding references", and took the process with it.)
func TestLog_CloseWhileAsking(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	db, err := store.OpenState(dir, store.Options{})
	require.NoError(t, err)
	var needs []provisioner.Message
	for i := 0; i < 20000; i++ {
		needs = append(needs, provisioner.Message{Seq: uint64(i + 1), Time: int64(i + 1), Key: fmt.Sprintf("n%05d.mod.nokind.x", i), Op: provisioner.OpPut, Value: []byte{0x01}})
	}
	require.NoError(t, db.Apply(provisioner.BucketNeeds, needs, 1, false))
	require.NoError(t, db.Close())

	for i := 0; i < 10; i++ {
		l, err := replay.OpenState(dir)
		require.NoError(t, err)
		closed := make(chan error, 1)
		started := make(chan struct{})
		go func() {
			<-started
			for j := 0; j < i*200; j++ {
				runtime.Gosched()
			}
			closed <- l.Close()
		}()
		close(started)
		_, err = l.Ask([]byte(`{"what":"needs","at":"seq:20000","limit":10}`))
		if err != nil {
			require.True(t, errors.Is(err, store.ErrClosed), "an Ask beside Close: %v", err)
		}
		require.NoError(t, <-closed)
		_, err = l.Ask([]byte(`{"what":"needs","at":"seq:20000"}`))
		require.ErrorIs(t, err, store.ErrClosed)
	}
}
