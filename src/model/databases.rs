//! `outbox.database`: which databases the relay works in. One name, a comma-separated list, or
//! `*` for every database that allows connections (templates aside) and has the extension.

/// What is wrong with a value of `outbox.database`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadSelection {
    /// No name, no `*`.
    Empty,
    /// `*` beside names.
    StarNotAlone,
    /// A name longer than PostgreSQL's (as the setting wrote it, made printable).
    TooLong(String),
}

impl std::fmt::Display for BadSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadSelection::Empty => {
                f.write_str("name a database, several separated by commas, or *")
            }
            BadSelection::StarNotAlone => {
                f.write_str("* stands alone: it already means every database")
            }
            BadSelection::TooLong(name) => {
                write!(f, "\"{name}\" is longer than a database name can be")
            }
        }
    }
}

/// The databases a setting names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// `*`: every database that allows connections and is not a template.
    All,
    /// These, by name, in the order given, each once. A name is bytes, as `pg_database` holds
    /// it: in the encoding of the session that named it, not necessarily UTF-8.
    Named(Vec<Vec<u8>>),
}

impl Selection {
    /// Reads the setting; says what is wrong with it otherwise.
    pub fn parse(setting: &[u8]) -> Result<Selection, BadSelection> {
        let items: Vec<&[u8]> = setting
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|s| !s.is_empty())
            .collect();
        if items == [b"*"] {
            return Ok(Selection::All);
        }
        if items.is_empty() {
            return Err(BadSelection::Empty);
        }
        let mut names: Vec<Vec<u8>> = Vec::new();
        for item in items {
            if item == b"*" {
                return Err(BadSelection::StarNotAlone);
            }
            if item.len() >= 64 {
                return Err(BadSelection::TooLong(
                    String::from_utf8_lossy(item).into_owned(),
                ));
            }
            if !names.iter().any(|n| n == item) {
                names.push(item.to_vec());
            }
        }
        Ok(Selection::Named(names))
    }

    /// Whether the database `name` (allowing connections, `template` or not) is selected.
    pub fn selects(&self, name: &[u8], template: bool) -> bool {
        match self {
            Selection::All => !template,
            Selection::Named(names) => names.iter().any(|n| n == name),
        }
    }

    /// Whether a worker should wait in a database without the extension (one named) or leave,
    /// for the launcher to look again later (any database, under `*`).
    pub fn waits_for_extension(&self) -> bool {
        matches!(self, Selection::Named(_))
    }
}

/// `prefix` with `{database}` replaced by the database's name.
pub fn stream_prefix(prefix: &str, database: &str) -> String {
    prefix.replace("{database}", database)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_name_a_list_or_every_database() {
        assert_eq!(
            Selection::parse(b"postgres"),
            Ok(Selection::Named(vec![b"postgres".to_vec()]))
        );
        assert_eq!(
            Selection::parse(b" shop, billing ,shop,, "),
            Ok(Selection::Named(vec![
                b"shop".to_vec(),
                b"billing".to_vec()
            ]))
        );
        assert_eq!(Selection::parse(b" * "), Ok(Selection::All));
        assert!(Selection::parse(b"").is_err());
        assert!(Selection::parse(b" , ").is_err());
        assert!(Selection::parse(b"shop,*").is_err());
        assert!(Selection::parse("x".repeat(64).as_bytes()).is_err());
    }

    #[test]
    fn every_database_leaves_out_templates_and_names_take_only_themselves() {
        let all = Selection::All;
        assert!(all.selects(b"shop", false));
        assert!(!all.selects(b"template1", true));
        assert!(!all.waits_for_extension());
        let named = Selection::parse(b"shop,template1").unwrap();
        assert!(named.selects(b"shop", false));
        assert!(named.selects(b"template1", true));
        assert!(!named.selects(b"billing", false));
        assert!(named.waits_for_extension());
    }

    #[test]
    fn a_name_that_is_not_utf8_selects_only_its_own_bytes() {
        // "läden" in LATIN1, and in UTF-8.
        let named = Selection::parse(b"l\xe4den, shop").unwrap();
        assert!(named.selects(b"l\xe4den", false));
        assert!(!named.selects("läden".as_bytes(), false));
        assert!(!named.selects(b"l\xf6den", false));
    }

    #[test]
    fn the_prefix_takes_the_database_name() {
        assert_eq!(stream_prefix("app:{database}:", "shop"), "app:shop:");
        assert_eq!(stream_prefix("{database}.{database}.", "a"), "a.a.");
        assert_eq!(stream_prefix("plain:", "shop"), "plain:");
    }
}
