//! Standard output of the commands. A reader that stops reading (`webproxy pools |
//! head`) ends the command quietly with success, where `println!` would panic.

use std::fmt;
use std::io::Write as _;

/// Standard output was closed by its reader: the command stops, and `main` exits 0
/// without a message, as a filter's upstream does in a pipeline.
#[derive(Debug)]
pub(crate) struct Closed;

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output closed by its reader")
    }
}

impl std::error::Error for Closed {}

/// Writes `text` to standard output; [`Closed`] when its reader has gone.
pub(crate) fn print(text: fmt::Arguments<'_>) -> anyhow::Result<()> {
    match std::io::stdout().lock().write_fmt(text) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Closed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to standard output")),
    }
}

/// Writes `bytes` to standard output as they are (a reply's body need not be text);
/// [`Closed`] when its reader has gone.
pub(crate) fn write_bytes(bytes: &[u8]) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Closed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to standard output")),
    }
}

/// `println!` that returns [`print`]'s result instead of panicking.
macro_rules! outln {
    () => {
        $crate::stdout::print(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::stdout::print(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that returns [`print`]'s result instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::stdout::print(format_args!($($arg)*))
    };
}
