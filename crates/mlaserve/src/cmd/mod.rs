//! One module per subcommand.

pub mod gen_model;
