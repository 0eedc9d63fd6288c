//! One module per subcommand.

pub mod bench;
pub mod gen_model;
