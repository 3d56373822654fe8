//! A host that installs its subscriber after the relay's threads exist still gets their logs
//! (minus lapin's payload lines): the quiet dispatcher forwards to the global one, whenever it
//! is set.
use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_subscriber_installed_later_still_hears_the_quiet_threads() {
    let (quieted, go) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            rabbit::quiet_lapin_payload_logs_on_this_thread();
            quieted.wait();
            go.wait();
            tracing::warn!("relay line after the host's subscriber");
            tracing::warn!(target: "lapin::returned_messages", "payload line");
        });
        quieted.wait();
        let captured = Captured::default();
        let writer = captured.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .init();
        go.wait();
        thread.join().unwrap();
        let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
        assert!(
            text.contains("relay line after the host's subscriber"),
            "the quiet thread's line was lost: {text:?}"
        );
        assert!(!text.contains("payload line"), "{text}");
    });
}
